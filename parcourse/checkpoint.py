"""Distributed checkpoints of a `Hybrid` run that load into another mesh (lesson 10).
(Saving a run to disk, as `torch.distributed.checkpoint`; `checkpointing.py` is the
other kind, activation checkpointing, as `torch.utils.checkpoint`.)

    path = save(model, "runs/x/checkpoints", step=100, extra={"loader": loader.state_dict()})
    ...                                                  # later, on any dp x tp x pp
    found = latest("runs/x/checkpoints")
    info = load(model, found)                            # info["step"], info["extra"]

The format is the ecosystem's, `torch.distributed.checkpoint` (DCP): every rank writes
the pieces it holds, described as DTensors on the mesh's tensor-parallel `DeviceMesh`
(a weight cut over tp is `Shard(dim)` of its whole shape; one left whole is a plain
tensor, written once however many ranks hold it); DCP's metadata records where each
piece sits in the whole tensor, so a load on another mesh reads the pieces it needs
and nothing else: resharding is DCP's, by offsets.

What is saved, under the unsplit model's names:
- `model.<name>`: every weight (a tied weight under each of its names; under mixed
  precision the fp32 masters, not the 16-bit copy the stages compute with);
- `optim.<name>.<key>`: the optimizer's state per weight, in the weight's layout
  (Adam's `exp_avg`, `exp_avg_sq`; `step` whole). Under ZeRO the state lives in flat
  slices over dp; it is gathered into each weight's shape before saving and cut into
  this mesh's slices after loading, so ZeRO on, off, or at another dp all load it;
- `rng`: one rank's CPU generator, set on every rank at load (the course's GPT has no
  dropout; the data order is the loader's own seed and position, kept in `extra`);
- `parcourse.json`: the step, the model's config, the mesh it was saved on, the names of
  the optimizer's state, an fp16 loss scaler's state (`ShardedGradScaler.state_dict()`)
  and what the caller put in `extra` (the loader's position, the corpus' hash, the
  settings).

A checkpoint is written into a hidden directory beside its final one and committed by
a rename once every rank has written (`os.replace`, atomic on one file system): a run
killed mid-save leaves the previous checkpoint, and `latest` never sees the half.

One file, read in the order of a checkpoint's life (what each rank holds as DTensors,
save, commit, find the latest, load into another mesh): each part is the other's mirror,
and a change to what is written must change what is read beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from parcourse.parts import AXES
from parcourse.ranges import chunk_bounds
from parcourse.tensor_parallel.state_dict import split_dims
from parcourse.zero.state_dict import load_sharded_optimizer_state, whole_optimizer_state

if TYPE_CHECKING:
    from parcourse.hybrid import Hybrid

META = "parcourse.json"
PREFIX = "step-"


def _directory(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root` (the highest step whose directory was
    committed and whose files hold every byte its index names, `problem`), or None when
    there is none."""
    return resume_problem(root)[0]


def _committed(root: str | os.PathLike) -> list[Path]:
    """The committed checkpoint directories under `root`, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith(PREFIX)
        and p.name[len(PREFIX) :].isdigit()
        and (p / META).is_file()
    ]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]), reverse=True)


def problem(path: str | os.PathLike) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, in one sentence naming the file (None:
    every file is there, as long as its index says): its metadata unreadable, DCP's index
    missing or unreadable, a shard missing or shorter than the bytes it should hold. Read
    in this process, before any rank starts."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    try:
        meta = read_meta(path)
        for key in ("step", "config", "state"):
            if key not in meta:
                return f"{path / META} lacks {key!r}"
    except (OSError, ValueError) as e:
        return f"{path / META} cannot be read ({type(e).__name__}: {e})"
    if not (path / ".metadata").is_file():
        return f"{path / '.metadata'} is missing (DCP's index of the shards)"
    try:
        index = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated pickle raises what unpickling raises
        return f"{path / '.metadata'} cannot be read ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size < size:
            return f"{file} holds {file.stat().st_size} bytes of the {size} its index names"
    return None


def resume_problem(root: str | os.PathLike) -> tuple[Path | None, str | None]:
    """For `--resume`: (the checkpoint it will use, a line naming any newer one that
    cannot be loaded and what it will use instead), in this process."""
    found, said = None, None
    for path in _committed(root):
        why = problem(path)
        if why is None:
            found = path
            break
        if said is None:
            said = why
    if said is not None:
        said += (
            "; --resume will use step "
            + found.name[len(PREFIX) :].lstrip("0")
            + " (the newest complete one)"
            if found is not None
            else "; no complete checkpoint is left to resume from"
        )
    return found, said


# -- the state, as DCP sees it


def _names(model: Hybrid) -> dict[int, list[str]]:
    """id(weight) -> its names in the unsplit model, for the weights this rank holds."""
    mine = {id(p) for p in model.params}
    names: dict[int, list[str]] = {}
    for name, p in model.model.named_parameters(remove_duplicate=False):
        if id(p) in mine:
            names.setdefault(id(p), []).append(name)
    return names


class _Layout:
    """How this rank's weights sit in the whole ones: a DTensor over the tp DeviceMesh
    for a weight cut over tp (without the zero rows that pad a vocabulary shard), over
    a part's axis for a weight that part cut along dim 0 (`Hybrid.cut_over`: the experts
    over ep, this rank's experts)."""

    def __init__(self, model: Hybrid) -> None:
        self.tp = model.mesh.size("tp")
        self.rank = model.mesh.coordinate("tp")
        self.dims = split_dims(model.model)
        self.device_mesh = model.mesh.device_mesh["tp"] if self.tp > 1 else None
        self.mesh, self.cut_over = model.mesh, model.cut_over

    def view(self, p: torch.nn.Parameter, t: torch.Tensor) -> Any:
        """`t`, shaped like this rank's piece of weight `p`, as DCP should store it."""
        from torch.distributed.tensor import DTensor, Shard

        if (axis := self.cut_over.get(id(p))) is not None:
            shape = (t.shape[0] * self.mesh.size(axis), *t.shape[1:])
            return DTensor.from_local(
                t,
                self.mesh.device_mesh[axis],
                [Shard(0)],
                run_check=False,
                shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride(),
            )
        if id(p) not in self.dims or self.tp == 1:
            return t

        dim, size = self.dims[id(p)]
        start, end = chunk_bounds(size, self.tp, "chunk")[self.rank]
        whole = list(t.shape)
        whole[dim] = size
        stride = torch.empty(whole, device="meta").stride()
        return DTensor.from_local(
            t.narrow(dim, 0, end - start),
            self.device_mesh,
            [Shard(dim)],
            run_check=False,
            shape=torch.Size(whole),
            stride=stride,
        )


def _optimizer_state(model: Hybrid) -> dict[int, dict[str, torch.Tensor]]:
    """id(weight) -> its optimizer state in the weight's shape (under ZeRO made whole from
    the dp shards, `zero.state_dict.whole_optimizer_state`), for the weights this rank
    holds."""
    if model.sharded is None:
        return {id(p): dict(model.optimizer.state.get(p, {})) for p in model.params}
    out: dict[int, dict[str, torch.Tensor]] = {id(p): {} for p in model.params}
    comms = {
        id(model.sharded.comm_of(u)): model.sharded.comm_of(u) for u in model.sharded.units
    }  # dp's, and the experts' copies' group
    for key, comm in comms.items():
        units = [u for u in model.sharded.units if id(model.sharded.comm_of(u)) == key]
        out.update(whole_optimizer_state(units, model.optimizer, comm))
    return out


def _buffers(model: Hybrid) -> dict[str, torch.Tensor]:
    """The saved buffers of this rank's stages, by name (an MoE router's balancing bias:
    the same on every replica, moved where its layer runs)."""
    mine = {id(b) for m in model.runtime.stages.values() for b in m.buffers()}
    kept = model.model.state_dict().keys()
    return {name: b for name, b in model.model.named_buffers() if id(b) in mine and name in kept}


def _dcp_state(
    model: Hybrid, keys: dict[str, bool] | None = None, buffers: list[str] | None = None
) -> tuple[dict[str, Any], dict[str, bool]]:
    """({DCP key: tensor or DTensor}, the optimizer's state names): this rank's weights
    and their optimizer state. `keys` (name -> shaped like the weight): what to hold,
    zeros where the optimizer has none yet (before its first step, or for a weight that
    never had a gradient), to load into; by default every name any weight has here.
    `buffers`: the buffers' names to hold (a load: what the checkpoint has); by default
    this rank's stages' saved buffers."""
    layout, names = _Layout(model), _names(model)
    # Given the names (a load), the state is only a place to load into: zeros, and no
    # gathering of ZeRO's slices that the load would overwrite.
    state = _optimizer_state(model) if keys is None else {id(p): {} for p in model.params}
    if keys is None:
        keys = {}
        for p in model.params:  # a frozen or unused weight has no state: ask them all
            for key, value in state[id(p)].items():
                if torch.is_tensor(value):
                    keys[key] = keys.get(key, False) or value.shape == p.shape
    out: dict[str, Any] = {}
    for p in model.params:
        for name in names[id(p)]:
            out[f"model.{name}"] = layout.view(p, p.data)
            for key, shaped in keys.items():
                held = state[id(p)].get(key)
                if held is None:
                    held = torch.zeros_like(p.data) if shaped else torch.zeros(())
                out[f"optim.{name}.{key}"] = layout.view(p, held) if shaped else held
    for name, b in _buffers(model).items():
        if buffers is None or name in buffers:
            out[f"model.{name}"] = b  # loaded in place
    return out, keys


# -- save and load


def save(
    model: Hybrid,
    root: str | os.PathLike,
    step: int,
    extra: dict[str, Any] | None = None,
    *,
    blocking: bool = True,
) -> Path | PendingSave:
    """Write a checkpoint of `model` after `step` steps under `root`, on every rank of its
    mesh (a collective); `extra`: anything JSON can hold (the loader's position, the
    corpus' hash, the settings). Returns the committed directory.

    `blocking=False`: DCP's `async_save`: the state is copied (the caller waits for that
    only) and written by a background thread, over a process group of its own, while
    training goes on; returns a `PendingSave` to `poll()` each step and `result()` before
    the next save and at the end (rank 0 commits when every rank has written)."""
    with model.whole_weights():  # ZeRO-3: gathered for the write, freed after
        return _save(model, root, step, extra, blocking)


def _save(
    model: Hybrid, root: str | os.PathLike, step: int, extra: dict[str, Any] | None, blocking: bool
) -> Path | PendingSave:
    import torch.distributed.checkpoint as dcp

    group = model.mesh.parent
    final = _directory(root, step)
    tmp = final.with_name(f".{final.name}.partial")
    rank = dist.get_rank(group)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left
        tmp.mkdir(parents=True)
    dist.barrier(group=group)
    state, keys = _dcp_state(model)
    state["rng"] = torch.get_rng_state()
    meta = {
        "step": step,
        "config": dataclasses.asdict(model.config),
        "mesh": {a: model.mesh.size(a) for a in AXES},
        "plan": model.plan.label(),
        "zero": model.zero,
        "optimizer": type(model.optimizer).__name__,
        "buffers": sorted(
            {n for n, _ in model.model.named_buffers()} & model.model.state_dict().keys()
        ),
        "state": keys,
        "extra": extra or {},
        # fp16's loss scaler: its scale and growth count, as a torch loop saves them
        "scaler": scaler.state_dict() if (scaler := model.precision.scaler) is not None else None,
    }
    if not blocking:
        if model.zero == 3:  # its weights are freed when this returns: DCP gets copies
            state = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        future = dcp.async_save(
            state, checkpoint_id=str(tmp), process_group=_background_group(model)
        )
        return PendingSave(future, rank, tmp, final, meta)
    dcp.save(state, checkpoint_id=str(tmp), process_group=group)
    if rank == 0:
        _write_meta_and_commit(tmp, final, meta)
    dist.barrier(group=group)
    return final


def _background_group(model: Hybrid) -> dist.ProcessGroup:
    """A gloo group over the model's ranks for the background writes (one per model, made
    at its first asynchronous save, on every rank): the training's collectives keep the
    mesh's groups to themselves, as DCP asks."""
    group = _BACKGROUND.get(model)
    if group is None:
        ranks = [
            dist.get_global_rank(model.mesh.parent, r)
            for r in range(dist.get_world_size(model.mesh.parent))
        ]
        group = _BACKGROUND[model] = dist.new_group(ranks, backend="gloo")
    return group


_BACKGROUND: weakref.WeakKeyDictionary[Any, dist.ProcessGroup] = weakref.WeakKeyDictionary()


class PendingSave:
    """A checkpoint being written in the background (`save(..., blocking=False)`)."""

    def __init__(
        self, future: Any, rank: int, tmp: Path, final: Path, meta: dict[str, Any]
    ) -> None:
        self.future, self.rank, self.tmp, self.final, self.meta = future, rank, tmp, final, meta
        self.committed = False

    def poll(self) -> bool:
        """Whether this rank's part is written (on rank 0: every rank's, and then it
        commits); never waits."""
        if not self.committed and self.future.done():
            self.result()
        return self.committed

    def result(self) -> Path:
        """Wait for the write; rank 0 commits it. The committed directory."""
        if not self.committed:
            self.future.result()  # raises what the background write raised
            if self.rank == 0:  # its future ends after every rank's write and the metadata
                _write_meta_and_commit(self.tmp, self.final, self.meta)
            self.committed = True
        return self.final


def _write_meta_and_commit(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    (tmp / META).write_text(json.dumps(meta, indent=1))
    _commit(tmp, final)


def _commit(tmp: Path, final: Path) -> None:
    """The rename that makes a checkpoint exist."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(path) / META).read_text())


def check_compatible(
    meta: dict[str, Any], config: Any, expect: dict[str, Any] | None = None
) -> None:
    """Refuse a checkpoint of another model (or, through `expect`, another corpus or
    settings: {key of extra: value}), naming what differs."""
    differ = [
        f"{k}: saved {v!r}, here {getattr(config, k)!r}"
        for k, v in meta["config"].items()
        if getattr(config, k, None) != v
    ]
    for k, v in (expect or {}).items():
        if meta["extra"].get(k) != v:
            differ.append(f"{k}: saved {meta['extra'].get(k)!r}, here {v!r}")
    if differ:
        raise ValueError("this checkpoint is of another run; " + "; ".join(differ))


@torch.no_grad()
def load(
    model: Hybrid, path: str | os.PathLike, expect: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Load the checkpoint at `path` into `model`, whatever mesh it was saved on (a
    collective over the model's mesh): weights (the fp32 masters under mixed precision),
    the optimizer's state (into ZeRO's slices if this model shards it), the loss
    scaler's state if both have one, and the CPU generator. Refuses one of another model or,
    with `expect`, other `extra` values. Returns its metadata (`step`, `extra`, ...)."""
    with model.whole_weights():  # ZeRO-3: loaded whole, each replica's slice taken,
        return _load(model, path, expect)  # then freed


@torch.no_grad()
def _load(model: Hybrid, path: str | os.PathLike, expect: dict[str, Any] | None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    meta = read_meta(path)
    check_compatible(meta, model.config, expect)
    if meta["optimizer"] != type(model.optimizer).__name__:
        raise ValueError(
            f"this checkpoint's optimizer is {meta['optimizer']}, this "
            f"model's {type(model.optimizer).__name__}"
        )
    keys = {k: bool(v) for k, v in meta["state"].items()}
    state, _ = _dcp_state(model, keys, meta.get("buffers", []))
    state["rng"] = torch.get_rng_state()
    try:
        dcp.load(state, checkpoint_id=str(path), process_group=model.mesh.parent)
    except Exception as e:  # DCP's own names no file: say which checkpoint, and why if known
        why = problem(path) or f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        raise ValueError(f"cannot load the checkpoint {path}: {why}") from None
    torch.set_rng_state(state["rng"])
    if model.precision.scaler is not None and meta.get("scaler"):
        model.precision.scaler.load_state_dict(meta["scaler"])
    names = _names(model)
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    per_weight: dict[int, dict[str, torch.Tensor]] = {}
    for p in model.params:
        name = names[id(p)][0]
        # DCP loaded into the weight itself (the state viewed it), all but the zero rows
        # that pad a vocabulary shard; copied only if it did not.
        loaded = local(state[f"model.{name}"])
        if loaded.data_ptr() != p.data.data_ptr():
            _copy_piece(p.data, loaded)
        per_weight[id(p)] = {}
        for key, shaped in keys.items():
            value = local(state[f"optim.{name}.{key}"])
            if shaped:
                whole = torch.zeros_like(p.data)
                _copy_piece(whole, value)
                value = whole
            per_weight[id(p)][key] = value.clone()
    _set_optimizer_state(model, per_weight)
    return meta


def _copy_piece(into: torch.Tensor, piece: torch.Tensor) -> None:
    """`piece` into the start of `into` along the one dim where they differ (a padded
    vocabulary shard), or whole."""
    for dim, (a, b) in enumerate(zip(into.shape, piece.shape)):
        if a != b:
            into.narrow(dim, 0, b).copy_(piece)
            return
    into.copy_(piece)


def _set_optimizer_state(model: Hybrid, per_weight: dict[int, dict[str, torch.Tensor]]) -> None:
    if model.sharded is None:
        for p in model.params:
            model.optimizer.state[p] = per_weight[id(p)]
        return
    model.sharded.load_weights()  # each shard takes its rows of the loaded weights
    load_sharded_optimizer_state(model.sharded.units, model.optimizer, per_weight)


def full_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The unsplit model's weights from a checkpoint, read in this process alone (no
    process group): what `sample` and a single-process GPT load."""
    import torch.distributed.checkpoint as dcp

    from parcourse.models import GPTConfig, gpt

    meta = read_meta(path)
    model = gpt(GPTConfig(**meta["config"]))
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    state = {f"model.{n}": torch.empty_like(model.get_parameter(n)) for n in names}
    state.update({f"model.{n}": model.get_buffer(n).clone() for n in meta.get("buffers", [])})
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    buffers = dict(model.named_buffers())
    return {
        k: state[f"model.{k}"] if f"model.{k}" in state else buffers[k] for k in model.state_dict()
    }
