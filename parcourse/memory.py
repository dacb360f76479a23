"""Where a rank's bytes go: live tensor storages counted by category.

Categories follow the ZeRO paper (arXiv:1910.02054, sec. 3): parameters,
gradients, optimizer state, activations saved for backward, and everything
else (temporary buffers). Bytes are counted from the *storages* behind tensors,
each storage once, so views and tied weights are not counted twice. A storage
that belongs to two categories counts in the first of CATEGORIES (a parameter
saved for backward is a parameter, not an activation).

On CPU there is no allocator to ask, so this is the measurement; psutil's RSS
includes the Python heap, torch's code and freed-but-cached pages, and does not
match the bytes the theory counts. On a GPU, `cuda_figures()` adds what the
caching allocator reports.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

CATEGORIES: tuple[str, ...] = ("params", "grads", "optimizer", "activations", "other")


@runtime_checkable
class _HoldsMemory(Protocol):
    """A model that says which tensors it holds, by category (a sharded model knows
    better than .parameters() what this rank holds)."""

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]: ...


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr())


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested lists, tuples, sets and dicts (e.g. optimizer.state)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from tensors_in(v)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


class SavedActivations:
    """Records the tensors autograd saves for backward inside a `with` block.

    >>> acts = SavedActivations()
    >>> with acts:
    ...     loss = model(x).sum()
    >>> acts.live_tensors()   # what backward will need; freed by backward

    Uses torch.autograd.graph.saved_tensors_hooks; the tensors are held through
    weak references, so a tensor freed by backward stops counting.
    """

    def __init__(self) -> None:
        self._refs: list[tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = []
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # Autograd keeps a detached alias (same storage), not `t`: a saved output's
        # grad_fn is the very node that saves it, and node -> t -> grad_fn -> node is a
        # cycle through C++ that Python's collector cannot see, so a graph freed without
        # running its backward (retain_graph, a split backward) would never be freed.
        # A tensor counts while autograd holds the alias or anyone still holds `t`.
        alias = t.detach()
        self._refs.append((weakref.ref(t), weakref.ref(alias)))
        return alias

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def live_tensors(self) -> list[torch.Tensor]:
        alive = [t() if t() is not None else alias() for t, alias in self._refs]
        self._refs = [r for r, t in zip(self._refs, alive) if t is not None]
        return [t for t in alive if t is not None]


class _Held:
    """What autograd keeps for one saved tensor while a `PeakSavedBytes` is watching:
    the tensor, and a note to the watcher when autograd lets go of it."""

    __slots__ = ("tensor", "watcher", "key")

    def __init__(self, tensor: torch.Tensor, watcher: PeakSavedBytes, key: tuple[str, int]) -> None:
        self.tensor, self.watcher, self.key = tensor, watcher, key

    def __del__(self) -> None:
        self.watcher._release(self.key)


class PeakSavedBytes:
    """Live bytes of the activations autograd holds for backward, and their peak, over
    a forward and its backward (tensors saved while backward recomputes included).

    >>> with PeakSavedBytes(exclude=model.parameters()) as saved:
    ...     model(x).sum().backward()
    >>> saved.peak

    Each storage counts once however often it is saved; tensors sharing storage with
    `exclude` (the parameters, which autograd saves too) do not count. `record=True`
    keeps every change as `history`, (perf_counter_ns, live bytes): the curve of a step.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), record: bool = False) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._refs: dict[tuple[str, int], int] = {}
        self._sizes: dict[tuple[str, int], int] = {}
        self.live = 0
        self.peak = 0
        self._hooks: Any = None
        self.history: list[tuple[int, int]] | None = [] if record else None

    def _pack(self, t: torch.Tensor) -> Any:
        key = _storage_key(t)
        if key in self._excluded:
            return t
        if key not in self._refs:
            self._refs[key] = 0
            self._sizes[key] = t.untyped_storage().nbytes()
            self.live += self._sizes[key]
            self.peak = max(self.peak, self.live)
            if self.history is not None:
                self.history.append((time.perf_counter_ns(), self.live))
        self._refs[key] += 1
        return _Held(t.detach(), self, key)  # detached: see SavedActivations._pack

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: tuple[str, int]) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)
            if self.history is not None:
                self.history.append((time.perf_counter_ns(), self.live))

    def __enter__(self) -> PeakSavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def live_bytes(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    activations: SavedActivations | None = None,
    other: Any = None,
) -> dict[str, int]:
    """Bytes of live storages by category; each storage counted once.

    `other` is any tensor or nested container of tensors (e.g. communication
    buffers) that belongs to none of the named categories.
    """
    groups: dict[str, list[torch.Tensor]] = {c: [] for c in CATEGORIES}
    if isinstance(model, _HoldsMemory):
        for category, tensors in model.memory_tensors().items():
            groups[category] = list(tensors)
    elif model is not None:
        groups["params"] = list(model.parameters())
        groups["grads"] = [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        if model is None:
            groups["params"] = opt_params
            groups["grads"] = [p.grad for p in opt_params if p.grad is not None]
        groups["optimizer"] += list(tensors_in(list(optimizer.state.values())))
    if activations is not None:
        groups["activations"] = activations.live_tensors()
    groups["other"] = groups["other"] + list(tensors_in(other))

    counted: set[tuple[str, int]] = set()
    result: dict[str, int] = {}
    for category in CATEGORIES:
        fresh = [t for t in groups[category] if _storage_key(t) not in counted]
        result[category] = storage_bytes(fresh)
        counted.update(_storage_key(t) for t in fresh)
    return result


def cuda_figures() -> dict[str, int] | None:
    """torch.cuda allocator figures for the current device, or None on CPU."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return {
        "allocated": torch.cuda.memory_allocated(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
    }


def byte_unit(n: float) -> tuple[str, int]:
    """The unit to write `n` bytes in, and its size: 1536 -> ("KiB", 1024)."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return unit, size
    return "B", 1


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    unit, size = byte_unit(n)
    return f"{n:.0f} B" if unit == "B" else f"{n / size:.1f} {unit}"
