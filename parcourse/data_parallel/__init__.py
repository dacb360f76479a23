"""Data parallelism from scratch: same weights everywhere, different data, gradients averaged."""

from parcourse.data_parallel import compress
from parcourse.data_parallel.bucketed import BucketedDataParallel, make_buckets
from parcourse.data_parallel.naive import NaiveDataParallel

__all__ = ["BucketedDataParallel", "NaiveDataParallel", "compress", "make_buckets"]
