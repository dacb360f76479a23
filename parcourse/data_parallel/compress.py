"""Gradients in fewer bits: communication hooks for `BucketedDataParallel`.

A hook replaces a bucket's all-reduce, as in torch's DDP: `model.register_comm_hook(state,
hook)`, where `hook(state, bucket)` gets the bucket (`GradBucket`: `buffer()`,
`gradients()`, `parameters()`, `index()`, `is_last()`, torch's `dist.GradBucket`'s
methods) and returns a future whose value is the bucket's gradients **averaged** over the
group. torch's own hooks run on the course's wrapper unchanged where they run on torch's
DDP: `default_hooks.allreduce_hook` and `fp16_compress_hook` on gloo too, while
`bf16_compress_hook` asks for NCCL, and torch's `powerSGD_hook` on gloo aborts a rank under
torch's own DDP (a collective waited on inside a gloo callback; seen here with torch
2.13). The course's hooks below run through a `Comm` on its own thread, on gloo and NCCL
alike, so each message is counted on its tracer and crosses its simulated link:

| hook | bytes a rank sends a step | error |
|---|---|---|
| none (fp32 all-reduce) | 2 (N-1)/N x 4S | the order of the sums |
| `low_precision_hook`, bf16 / fp16 | 2 (N-1)/N x 2S | 8 (11) bits of mantissa, hop by hop |
| `low_precision_hook`, e4m3 / e5m2 | 2 (N-1)/N x S (1 + 4/block) | 3 (2) bits, a scale a block |
| `powerSGD_hook`, rank r | 2 (N-1)/N x 4 r (n + m) a matrix n x m | low rank, error fed back |

(S: the bucket's elements, N: ranks.)

FP8 cannot be summed hop after hop (a sum of FP8 numbers in FP8 loses all but 3 bits each
time), so the FP8 all-reduce is a reduce-scatter by all-to-all (each rank's chunk j,
quantized with a scale per block of 1 x `block`, goes to rank j, which sums what arrives in
fp32) followed by an all-gather of the quantized sums: two quantizations in all, whatever
N. PowerSGD (Vogels et al. 2019) sends P = M Q and Q = Mᵀ P (orthonormalised P) for
each gradient matrix M instead of M, and keeps what the rank-r product misses (the
error) to add to the next step's gradient; with r = min(n, m) it is the all-reduce itself.

`Measured(state, hook, group)` with `measured_hook` wraps any hook and records, each step,
how far its average lies from the exact fp32 one (`errors`, relative, over all buckets),
by a second, uncounted fp32 all-reduce: for measuring, not for training fast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from parcourse import fp8
from parcourse.comm import Comm, Pending, all_to_all

__all__ = [
    "WIRE_FORMATS",
    "GradBucket",
    "LowPrecision",
    "Measured",
    "PowerSGDState",
    "low_precision_hook",
    "measured_hook",
    "fp8_all_reduce",
    "powerSGD_hook",
    "powersgd_bytes",
    "wire_bytes",
]

WIRE_FORMATS: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}


class GradBucket:
    """What a communication hook is handed: one bucket, with the methods of torch's
    `dist.GradBucket`. `buffer()` is the bucket's gradients, flat, one parameter after
    another; `gradients()` views into it, one a parameter, in its shape."""

    def __init__(
        self, index: int, buffer: torch.Tensor, params: list[nn.Parameter], last: bool
    ) -> None:
        self._index, self._buffer, self._params, self._last = index, buffer, params, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        views, at = [], 0
        for p in self._params:
            views.append(self._buffer[at : at + p.numel()].view_as(p))
            at += p.numel()
        return views

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._last


class Future(Protocol):
    def wait(self) -> torch.Tensor: ...


Hook = Callable[[Any, GradBucket], Future]


class _OnComm:
    """A hook's state that sends through a `Comm`, made from a group on first use."""

    _comm_or_group: Comm | dist.ProcessGroup | None

    @property
    def comm(self) -> Comm:
        if not isinstance(self._comm_or_group, Comm):
            self._comm_or_group = Comm(self._comm_or_group)
        return self._comm_or_group


# --------------------------------------------------------------------- fewer bits


class LowPrecision(_OnComm):
    """The state of `low_precision_hook`: the `Comm` (or group) its messages go through,
    the wire format (`fmt`: "bf16", "fp16", "e4m3" or "e5m2") and, for FP8, the elements
    that share one fp32 scale (`block`, DeepSeek-V3's 128)."""

    def __init__(
        self, comm: Comm | dist.ProcessGroup | None = None, fmt: str = "bf16", block: int = 128
    ) -> None:
        if fmt not in WIRE_FORMATS:
            raise ValueError(f"fmt must be one of {', '.join(WIRE_FORMATS)}, got {fmt!r}")
        if not (isinstance(block, int) and block >= 1):
            raise ValueError(f"block must be a whole number >= 1, got {block!r}")
        self._comm_or_group, self.fmt, self.block = comm, fmt, block

    def __repr__(self) -> str:
        return f"LowPrecision({self._comm_or_group!r}, fmt={self.fmt!r}, block={self.block})"


def low_precision_hook(state: LowPrecision, bucket: GradBucket) -> Pending:
    """The bucket averaged over the group with its messages in `state.fmt`: bf16 / fp16 by
    the ring in that dtype (divided by N first, as torch's `bf16_compress_hook`), FP8 by
    a quantized all-to-all then a quantized all-gather (see the module's docstring)."""
    buffer = bucket.buffer()
    comm = state.comm
    if state.fmt in ("bf16", "fp16"):
        wire = buffer.to(WIRE_FORMATS[state.fmt]).div_(comm.size)

        def half() -> torch.Tensor:
            comm.all_reduce(wire)
            return buffer.copy_(wire)

        return comm.submit(half)
    return comm.submit(lambda: buffer.copy_(fp8_all_reduce(comm, buffer, state.fmt, state.block)))


def _encode(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """x (rows, cols; cols a multiple of block) as uint8 rows: [FP8 values | fp32 scales]."""
    q = fp8.quantize(x, fmt, "block", (1, block))  # type: ignore[arg-type]
    rows = x.shape[0]
    values = q.data.view(torch.uint8).reshape(rows, -1)
    return torch.cat([values, q.scale.view(rows, -1).view(torch.uint8)], dim=1)


def _decode(msg: torch.Tensor, cols: int, fmt: str, block: int) -> torch.Tensor:
    """The fp32 rows that `_encode` made `msg` of."""
    data = msg[:, :cols].contiguous().view(WIRE_FORMATS[fmt])
    scale = msg[:, cols:].contiguous().view(torch.float32).reshape(-1)
    return fp8.dequantize(fp8.Scaled(data, scale, "block", (1, block)))


def fp8_all_reduce(
    comm: Comm, x: torch.Tensor, fmt: str = "e4m3", block: int = 128
) -> torch.Tensor:
    """The average of 1-D `x` over the group, its messages in FP8 with a scale a block:
    chunk j of every rank to rank j (all-to-all), summed there in fp32 (this rank's own
    chunk exact), the sums quantized once more and all-gathered. A new fp32 tensor."""
    n, size = x.numel(), comm.size
    width = math.ceil(n / size / block) * block or block  # a chunk: whole blocks
    padded = torch.zeros(size * width, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    chunks = padded.view(size, width)
    sent = _encode(chunks, fmt, block)  # (size, width + 4 width / block) bytes
    got = all_to_all(comm, sent, [1] * size, [1] * size)
    arrived = _decode(got, width, fmt, block)
    arrived[comm.rank] = chunks[comm.rank]  # what stays here is not quantized
    mine = arrived.sum(dim=0).div_(size)
    message = _encode(mine.view(1, width), fmt, block).view(-1)
    whole = torch.empty(size * message.numel(), dtype=torch.uint8, device=x.device)
    comm.all_gather(message, whole)
    return _decode(whole.view(size, -1), width, fmt, block).view(-1)[:n]


def wire_bytes(numel: int, world_size: int, fmt: str = "fp32", block: int = 128) -> float:
    """Bytes one bucket of `numel` gradients costs the ranks altogether (summed over ranks,
    exact for the course's ring and all-to-all): 2 (N-1) x numel x bytes an element for an
    all-reduce (fp32, bf16, fp16); for FP8, 2 (N-1) chunks of whole blocks (1 byte a value,
    4 a block's scale)."""
    if world_size == 1:
        return 0.0
    if fmt in ("fp32", "bf16", "fp16"):
        return 2 * (world_size - 1) * numel * {"fp32": 4, "bf16": 2, "fp16": 2}[fmt]
    if fmt not in WIRE_FORMATS:
        raise ValueError(f"unknown wire format {fmt!r}")
    width = math.ceil(numel / world_size / block) * block or block
    return 2 * (world_size - 1) * world_size * (width + 4 * width // block)


# --------------------------------------------------------------------- PowerSGD


class PowerSGDState(_OnComm):
    """The state of `powerSGD_hook`, with torch's `PowerSGDState`'s names and defaults:
    `matrix_approximation_rank` (r), `start_powerSGD_iter` (plain all-reduces before it:
    the first steps' gradients are too far from low rank), `use_error_feedback`,
    `warm_start` (each step's Q starts from the last's; torch asks `start_powerSGD_iter` > 1
    with it, as DDP rebuilds its buckets after the first step, and the course's buckets
    never change, so 0 is allowed), `random_seed` (the first Q, the
    same on every rank), `min_compression_rate` (a tensor, seen as a matrix n x m of its
    first dimension by the rest, is compressed where r (n + m) x this rate < n m; the
    others travel whole). `comm` (or a group): where the messages go. `iter`: the steps
    done."""

    def __init__(
        self,
        comm: Comm | dist.ProcessGroup | None = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        random_seed: int = 0,
    ) -> None:
        if not (isinstance(matrix_approximation_rank, int) and matrix_approximation_rank >= 1):
            raise ValueError(
                f"matrix_approximation_rank must be a whole number >= 1, got "
                f"{matrix_approximation_rank!r}"
            )
        if start_powerSGD_iter < 0:
            raise ValueError(f"start_powerSGD_iter must be >= 0, got {start_powerSGD_iter}")
        self._comm_or_group = comm
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback, self.warm_start = use_error_feedback, warm_start
        self.random_seed = random_seed
        self.iter = 0
        self.errors: dict[int, torch.Tensor] = {}  # bucket -> what the last step missed
        self.qs: dict[int, list[torch.Tensor]] = {}  # bucket -> each matrix's Q

    def __repr__(self) -> str:
        return (
            f"PowerSGDState({self._comm_or_group!r}, matrix_approximation_rank="
            f"{self.matrix_approximation_rank}, start_powerSGD_iter={self.start_powerSGD_iter})"
        )

    def rank_for(self, n: int, m: int) -> int | None:
        """The rank a matrix n x m is sent at, or None where it travels whole."""
        r = min(n, m, self.matrix_approximation_rank)
        return r if r * (n + m) * self.min_compression_rate < n * m else None


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """The columns of p, orthonormalised (reduced QR; the same on every rank, as p is)."""
    return torch.linalg.qr(p, mode="reduced")[0]


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> Pending:
    """The bucket's gradients averaged at low rank (torch's `powerSGD_hook`, step for step):
    the error fed back, P = M Q all-reduced and orthonormalised, Q = Mᵀ P all-reduced and
    averaged, M ≈ P Qᵀ, the new error M - P Qᵀ kept. Tensors that do not compress go in one
    plain all-reduce first."""
    comm, index = state.comm, bucket.index()
    buffer = bucket.buffer()
    compress = state.iter >= state.start_powerSGD_iter
    if bucket.is_last():
        state.iter += 1
    if not compress:

        def plain() -> torch.Tensor:
            return comm.all_reduce(buffer).div_(comm.size)

        return comm.submit(plain)

    def run() -> torch.Tensor:
        if state.use_error_feedback:
            if index in state.errors:
                buffer.add_(state.errors[index])
            before = buffer.clone()
        grads = bucket.gradients()
        matrices: list[torch.Tensor] = []
        ranks: list[int] = []
        whole: list[torch.Tensor] = []
        for g in grads:
            mat = g.view(g.shape[0], -1) if g.dim() > 0 else g.view(1, 1)
            r = state.rank_for(*mat.shape) if g.dim() > 0 else None
            if r is None:
                whole.append(g)
            else:
                matrices.append(mat)
                ranks.append(r)
        if whole:
            flat = torch.cat([g.reshape(-1) for g in whole])
            comm.all_reduce(flat).div_(comm.size)
            at = 0
            for g in whole:
                g.copy_(flat[at : at + g.numel()].view_as(g))
                at += g.numel()
        if matrices:
            qs = state.qs.get(index) if state.warm_start else None
            if qs is None:
                gen = torch.Generator().manual_seed(state.random_seed + 1_000_003 * index)
                qs = [
                    torch.randn(m.shape[1], r, generator=gen).to(m.device, m.dtype)
                    for m, r in zip(matrices, ranks)
                ]
            ps = [m @ _orthonormal(q) for m, q in zip(matrices, qs)]
            flat_p = comm.all_reduce(torch.cat([p.reshape(-1) for p in ps]))
            ps, at = [], 0
            for m, r in zip(matrices, ranks):
                ps.append(_orthonormal(flat_p[at : at + m.shape[0] * r].view(m.shape[0], r)))
                at += m.shape[0] * r
            flat_q = comm.all_reduce(
                torch.cat([(m.T @ p).reshape(-1) for m, p in zip(matrices, ps)])
            )
            flat_q.div_(comm.size)
            qs, at = [], 0
            for m, p, r in zip(matrices, ps, ranks):
                q = flat_q[at : at + m.shape[1] * r].view(m.shape[1], r)
                at += m.shape[1] * r
                m.copy_(p @ q.T)  # in place: m is a view into the bucket's buffer
                qs.append(q.clone())
            state.qs[index] = qs
        if state.use_error_feedback:
            state.errors[index] = before - buffer
        return buffer

    return comm.submit(run)


def powersgd_bytes(
    shapes: list[torch.Size], world_size: int, rank: int, min_compression_rate: float = 2
) -> float:
    """Bytes a bucket of tensors of `shapes` costs the ranks altogether a PowerSGD step at
    `rank` (fp32): the whole tensors' all-reduce, then P's (n r a matrix) and Q's (m r)."""
    state = PowerSGDState.__new__(PowerSGDState)
    state.matrix_approximation_rank, state.min_compression_rate = rank, min_compression_rate
    whole = p = q = 0
    for shape in shapes:
        numel = math.prod(shape)
        r = state.rank_for(shape[0], numel // shape[0]) if len(shape) > 0 else None
        if r is None:
            whole += numel
        else:
            p, q = p + shape[0] * r, q + (numel // shape[0]) * r
    return sum(wire_bytes(k, world_size) for k in (whole, p, q) if k)


# --------------------------------------------------------------------- measuring


class Measured:
    """A hook and its state, and the error of what it returns against the exact fp32
    average, step by step: `errors[i]` = |got - exact| / |exact| over all buckets of step
    i. The exact average comes from a second all-reduce on `group`, through torch (not
    counted on any tracer)."""

    def __init__(self, state: Any, hook: Hook, group: dist.ProcessGroup | None = None) -> None:
        self.state, self.hook, self.group = state, hook, group
        self.errors: list[float] = []
        self._num = self._den = 0.0

    def __repr__(self) -> str:
        return f"Measured({self.state!r}, {getattr(self.hook, '__name__', self.hook)})"


def measured_hook(measured: Measured, bucket: GradBucket) -> torch.futures.Future:
    """`measured.hook`'s result, its error against the fp32 average recorded."""
    exact = bucket.buffer().detach().clone()
    got = measured.hook(measured.state, bucket).wait()
    size = dist.get_world_size(measured.group)
    dist.all_reduce(exact, group=measured.group)
    exact.div_(size)
    measured._num += float((got.float() - exact).square().sum())
    measured._den += float(exact.square().sum())
    if bucket.is_last():
        measured.errors.append(math.sqrt(measured._num / measured._den) if measured._den else 0.0)
        measured._num = measured._den = 0.0
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(got)
    return done
