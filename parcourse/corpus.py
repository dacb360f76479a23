"""Real text that every machine already has (lesson 10): the Python standard library's own
source files, as bytes (a vocabulary of 256: nothing to download, nothing to train), in a
token file the ranks memory-map (nanoGPT's way), with a validation split by file, and a
loader that gives each data-parallel replica its own rows of every global batch and can
be stopped and resumed exactly.

    corpus = build_corpus("runs/corpus")            # once; later calls reuse it
    loader = ShardedLoader(corpus.train, block_size=64, batch=16, replica=r, replicas=dp)
    x, y = loader.next()                             # this replica's rows, y = x shifted
    state = loader.state_dict()                      # part of a checkpoint

Deterministic: the same interpreter version gives the same files in the same order, the
same split and the same bytes, whose SHA-256 `meta["sha256"]` prints and a checkpoint can
compare against.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parcourse.ranges import chunk_bounds

SEPARATOR = b"\n\n"  # between files: a paragraph break, a token the model already knows
SKIP = {"site-packages", "test", "tests", "idlelib", "__pycache__"}


def source_files(root: str | Path | None = None, packages: list[str] | None = None) -> list[Path]:
    """The standard library's .py files (not its tests, IDLE or installed packages),
    sorted by path relative to `root` (the running interpreter's stdlib by default);
    `packages`: only these top-level modules or packages (for a small corpus)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if SKIP & set(relative.parts):
            continue
        if packages is not None and relative.parts[0].removesuffix(".py") not in packages:
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_validation(relative: str, fraction: float) -> bool:
    """Whether a file goes to validation: by a hash of its path, so the split is by file
    (no file in both), the same on every machine, and about `fraction` of the files."""
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


@dataclass
class Corpus:
    """A built corpus: `train` and `val` token arrays (uint8, memory-mapped), `meta`."""

    directory: Path
    train: np.ndarray
    val: np.ndarray
    meta: dict[str, Any]


def build_corpus(
    directory: str | Path,
    *,
    root: str | Path | None = None,
    packages: list[str] | None = None,
    val_fraction: float = 0.05,
) -> Corpus:
    """Write `train.bin` and `val.bin` (bytes of the files, each followed by a blank line)
    and `meta.json` under `directory`, unless a corpus of the same sources is already
    there; then open it. Files are written to new names and renamed into place, so a
    build killed half way leaves nothing that looks complete."""
    directory = Path(directory)
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = source_files(root, packages)
    if not files:
        raise ValueError(f"no .py files under {root}" + (f" in {packages}" if packages else ""))
    names = [f.relative_to(root).as_posix() for f in files]
    sources = hashlib.sha256("\n".join(names).encode() + repr(val_fraction).encode())
    for f in files:
        sources.update(str(f.stat().st_size).encode())
    key = {"python": sys.version.split()[0], "sources": sources.hexdigest()}
    meta_path = directory / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if {k: meta.get(k) for k in key} == key:
            return open_corpus(directory)
    directory.mkdir(parents=True, exist_ok=True)
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    for path, name in zip(files, names):
        split = "val" if is_validation(name, val_fraction) else "train"
        parts[split].append(path.read_bytes() + SEPARATOR)
        counts[split] += 1
    digest = hashlib.sha256()
    for split in ("train", "val"):
        data = b"".join(parts[split])
        digest.update(data)
        tmp = directory / f".{split}.bin.{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, directory / f"{split}.bin")
    meta = {
        **key,
        "root": str(root),
        "files": counts,
        "val_fraction": val_fraction,
        "bytes": {s: (directory / f"{s}.bin").stat().st_size for s in ("train", "val")},
        "vocab": 256,
        "sha256": digest.hexdigest(),
    }
    tmp = directory / f".meta.json.{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_path)  # last: its presence says the corpus is whole
    return open_corpus(directory)


def open_corpus(directory: str | Path) -> Corpus:
    directory = Path(directory)
    meta_path = directory / "meta.json"
    if not meta_path.exists():
        raise ValueError(f"no corpus at {directory} (build it with build_corpus)")
    meta = json.loads(meta_path.read_text())
    arrays = {
        s: np.memmap(directory / f"{s}.bin", dtype=np.uint8, mode="r")
        if meta["bytes"][s]
        else np.zeros(0, dtype=np.uint8)  # a split with no file
        for s in ("train", "val")
    }
    return Corpus(directory, arrays["train"], arrays["val"], meta)


class ShardedLoader:
    """Global batches of `batch` windows of `block_size` + 1 tokens (inputs and targets
    shifted by one), windows taken at a stride of `block_size` over `tokens` in an order
    shuffled each epoch (by `seed` and the epoch); replica `replica` of `replicas` reads
    its own contiguous rows of each global batch (`chunk_bounds`: disjoint, covering).

    Every rank of a replica (its tp and pp ranks) builds the same loader and reads the
    same rows. Where torch's DistributedSampler pads the last batch of an epoch with
    repeated samples (drop_last=False), this drops the windows that do not fill a global
    batch, and each replica gets rows of one global batch, not every replicas-th sample.
    `state_dict()` (epoch and position) makes a resumed run read exactly what the
    uninterrupted one would have."""

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        batch: int,
        *,
        replica: int = 0,
        replicas: int = 1,
        seed: int = 0,
    ) -> None:
        if block_size < 1 or batch < 1:
            raise ValueError(f"block_size and batch must be >= 1, got {block_size}, {batch}")
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} is not one of {replicas}")
        if batch < replicas:
            raise ValueError(
                f"a global batch of {batch} cannot give each of {replicas} replicas a row"
            )
        self.tokens, self.block_size, self.batch = tokens, block_size, batch
        self.replica, self.replicas, self.seed = replica, replicas, seed
        self.windows = (len(tokens) - 1) // block_size
        if self.windows < batch:
            raise ValueError(
                f"{len(tokens)} tokens hold {self.windows} windows of "
                f"{block_size}: fewer than one global batch of {batch}"
            )
        self.epoch, self.position = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.windows, generator=g)

    @property
    def batches_per_epoch(self) -> int:
        return self.windows // self.batch

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's rows of the next global batch: (inputs, targets), int64."""
        if self.position + self.batch > self.windows:  # the rest does not fill a batch
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._shuffle()
        start, end = chunk_bounds(self.batch, self.replicas)[self.replica]
        picked = self._order[self.position + start : self.position + end]
        self.position += self.batch
        rows = np.stack(
            [
                self.tokens[w * self.block_size : w * self.block_size + self.block_size + 1]
                for w in picked.tolist()
            ]
        )
        data = torch.from_numpy(rows.astype(np.int64))
        return data[:, :-1], data[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch": self.batch,
            "block_size": self.block_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "batch", "block_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"this loader's {key} is {getattr(self, key)}, the saved "
                    f"one's {state[key]}: resume with the same settings"
                )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffle()
