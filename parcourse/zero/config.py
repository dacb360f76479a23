"""A DeepSpeed-style configuration: `zero.from_config(model, "ds_config.json")` builds the
course's ZeRO from the keys a user already has in a `ds_config.json`, and returns an
engine used as DeepSpeed's is:

    engine = zero.from_config(net, {"zero_optimization": {"stage": 2},
                                    "bf16": {"enabled": True},
                                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                    "train_micro_batch_size_per_gpu": 8,
                                    "gradient_accumulation_steps": 4,
                                    "gradient_clipping": 1.0})
    for x, y in batches:                       # micro-batches
        loss = loss_fn(engine(x), y)
        engine.backward(loss)                  # scaled by 1 / accumulation steps
        engine.step()                          # steps only at an accumulation boundary

Every key is either built into the same classes as the Python API (`ZeroModel`, a torch
optimizer over its shards) or refused by name, with the keys that are supported: nothing is
accepted and then ignored. `"auto"` is filled where the model or the group says what it
must be (a bucket size, the global batch) and refused where only the user can (a
learning rate).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm.common import group_info
from parcourse.zero.infinity import InfinityOptimizer
from parcourse.zero.loss_scale import LossScale, check_fp16_section, found_inf
from parcourse.zero.model import Stage, ZeroModel
from parcourse.zero.sharded_optimizer import guard_shard_state
from parcourse.zero.stage1 import ZeroStage1

TOP_LEVEL = (
    "zero_optimization",
    "bf16",
    "fp16",
    "optimizer",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
)
ZERO_KEYS = (
    "stage",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
    "offload_optimizer",
    "offload_param",
    "zero_quantized_weights",
    "zero_hpz_partition_size",
    "zero_quantized_gradients",
)
OFFLOAD_OPTIMIZER_KEYS = ("device", "nvme_path", "pin_memory")
OFFLOAD_PARAM_KEYS = ("device", "pin_memory")
OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}
# DeepSpeed keys this course has not built: refused with what they would do.
NOT_YET = {
    "buffer_count": "DeepSpeed's count of NVMe swap buffers (the course keeps three units' "
    "state in flight)",
    "max_in_cpu": "a cap on offloaded parameters kept in host memory",
}
DEFAULT_BUCKET_BYTES = 25 * 2**20


def _read(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    path = Path(config)
    if not path.exists():
        raise ValueError(f"no configuration file at {path}")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from e
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} holds a {type(loaded).__name__}, not a JSON object")
    return loaded


def _refuse_unknown(keys: Any, known: tuple[str, ...], where: str) -> None:
    for key in keys:
        if key in NOT_YET:
            raise ValueError(
                f"{where}{key!r} asks for {NOT_YET[key]}, which this course does "
                f"not build yet; supported here: {', '.join(known)}"
            )
        if key not in known:
            raise ValueError(f"unknown key {where}{key!r}; supported: {', '.join(known)}")


def _flag(section: Any, name: str) -> bool:
    if section is None:
        return False
    if not isinstance(section, dict) or set(section) - {"enabled"}:
        raise ValueError(f'{name!r} takes {{"enabled": true or false}} only, got {section!r}')
    enabled = section.get("enabled", False)
    if enabled == "auto":
        raise ValueError(
            f"{name}.enabled 'auto': say true or false (it depends on your GPU, "
            "which this configuration cannot see)"
        )
    return bool(enabled)


def _bucket_mb(zero: dict[str, Any]) -> float:
    sizes = {k: zero[k] for k in ("reduce_bucket_size", "allgather_bucket_size") if k in zero}
    values = {k: DEFAULT_BUCKET_BYTES if v == "auto" else v for k, v in sizes.items()}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(
                f"zero_optimization.{key} must be a positive number of bytes "
                f"(or 'auto'), got {value!r}"
            )
    if len(set(values.values())) > 1:
        raise ValueError(
            "reduce_bucket_size and allgather_bucket_size differ; this course "
            "moves gradients and weights in the same units: give one size"
        )
    return next(iter(values.values()), DEFAULT_BUCKET_BYTES) / 2**20


def _optimizer(spec: Any) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if spec is None:
        raise ValueError(
            'no \'optimizer\' section: give {"type": "AdamW", "params": '
            '{"lr": ...}} (the engine builds the optimizer over the shards)'
        )
    if not isinstance(spec, dict) or set(spec) - {"type", "params"}:
        raise ValueError(f"'optimizer' takes 'type' and 'params', got {spec!r}")
    kind = spec.get("type")
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer type {kind!r} is not one of {', '.join(OPTIMIZERS)}")
    params = dict(spec.get("params", {}))
    for key, value in params.items():
        if value == "auto":
            raise ValueError(f"optimizer.params.{key} 'auto': only you know it; give a value")
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return OPTIMIZERS[kind], params


class ZeroEngine:
    """What `from_config` returns: the sharded model (`module`, a `ZeroModel`), its
    optimizer (`optimizer`, a torch optimizer over the shards), and DeepSpeed's loop:
    `engine(x)` runs the model, `engine.backward(loss)` scales the loss by 1 /
    `accumulation_steps` (and by the loss scale under fp16) and keeps gradients local
    (`no_sync`) until the last micro-batch of a step, `engine.step()` clips
    (`gradient_clipping`, by the global norm) and steps at that boundary only, and zeroes
    the gradients after.

    Under fp16 (`loss_scale`, a `LossScale`), `step()` first asks every rank whether its
    gradient rows hold an inf or a nan: if any does, the step is skipped on every rank
    (`skipped_steps` counts them); else the gradients are divided by the scale before
    clipping. Then the scale changes by DeepSpeed's rules (loss_scale.py)."""

    def __init__(
        self,
        module: ZeroStage1,
        optimizer: Any,
        *,
        micro_batch: int | None,
        accumulation_steps: int,
        clipping: float | None,
        loss_scale: LossScale | None = None,
    ) -> None:
        self.module, self.optimizer = module, optimizer
        self.micro_batch, self.accumulation_steps = micro_batch, accumulation_steps
        self.clipping = clipping
        self.loss_scale = loss_scale
        self.micro_steps = 0
        self.skipped_steps = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        quiet = not self.is_gradient_accumulation_boundary()
        scale = self.loss_scale.scale if self.loss_scale is not None else 1.0
        with self.module.no_sync() if quiet else nullcontext():
            (loss * (scale / self.accumulation_steps)).backward()
        self.micro_steps += 1

    def step(self) -> bool:
        """Step at the end of an accumulation; True there (a step skipped for an overflow
        included: `skipped_steps`)."""
        if self.micro_steps % self.accumulation_steps:
            return False
        if self.loss_scale is not None:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            overflow = found_inf(grads, self.module.group, self.module.units[0].full.device)
            if overflow:
                self.skipped_steps += 1
                self.loss_scale.update(True)
                self.optimizer.zero_grad(set_to_none=True)
                return True
            for g in grads:
                g.div_(self.loss_scale.scale)
            self.loss_scale.update(False)
        if self.clipping is not None:
            self.module.clip_grad_norm_(self.clipping)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True


@dataclass(frozen=True)
class _Checked:
    """What a configuration asks for, every key checked (`check_config`)."""

    stage: Stage
    dtype: torch.dtype | None
    micro: int | None
    accumulation: int
    clipping: float | None
    optimizer: type[torch.optim.Optimizer]
    params: dict[str, Any]
    options: dict[str, Any]
    bucket_mb: float
    loss_scale: LossScale | None = None


def check_config(config: dict[str, Any] | str | Path, world_size: int) -> _Checked:
    """Every rule `from_config` applies to a configuration for `world_size` ranks, without a
    model or a process group: call it before starting ranks, so that a refused key is one
    ValueError here rather than the same error on every rank."""
    config = _read(config)
    _refuse_unknown(config, TOP_LEVEL, "")
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or "stage" not in zero:
        raise ValueError("'zero_optimization' with a 'stage' (1, 2 or 3) is required")
    _refuse_unknown(zero, ZERO_KEYS, "zero_optimization.")
    stage = zero["stage"]
    if stage == 0:
        raise ValueError(
            "zero_optimization.stage 0 is plain data parallelism: use "
            "parcourse.data_parallel (this builds ZeRO stages 1-3)"
        )
    if stage not in (1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 1, 2 or 3, got {stage!r}")
    for key in ("overlap_comm", "contiguous_gradients"):
        if zero.get(key, True) is not True:
            raise ValueError(
                f"zero_optimization.{key} false: this course always overlaps "
                "communication and keeps gradients in contiguous units"
            )
    bf16, fp16 = _flag(config.get("bf16"), "bf16"), check_fp16_section(config.get("fp16"))
    if bf16 and fp16:
        raise ValueError("bf16 and fp16 are both enabled: choose one")
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else None

    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps", 1)
    if accumulation == "auto":
        accumulation = 1
    for name, value in (
        ("train_micro_batch_size_per_gpu", micro),
        ("gradient_accumulation_steps", accumulation),
    ):
        if (
            value is not None
            and value != "auto"
            and (isinstance(value, bool) or not isinstance(value, int) or value < 1)
        ):
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if micro == "auto":
        micro = None
    total = config.get("train_batch_size")
    if total is not None and total != "auto":
        if micro is None:
            raise ValueError(
                "train_batch_size without train_micro_batch_size_per_gpu: give the micro-batch too"
            )
        if total != micro * accumulation * world_size:
            raise ValueError(
                f"train_batch_size {total} != train_micro_batch_size_per_gpu "
                f"{micro} x gradient_accumulation_steps {accumulation} x "
                f"{world_size} ranks = {micro * accumulation * world_size}"
            )
    clipping = config.get("gradient_clipping")
    if clipping is not None and (
        isinstance(clipping, bool) or not isinstance(clipping, (int, float)) or clipping <= 0
    ):
        raise ValueError(f"gradient_clipping must be a positive number, got {clipping!r}")
    kind, params = _optimizer(config.get("optimizer"))
    return _Checked(
        stage,
        dtype,
        micro,
        accumulation,
        float(clipping) if clipping is not None else None,
        kind,
        params,
        _beyond_stage_3(zero, stage),
        _bucket_mb(zero),
        fp16,
    )


def from_config(
    model: nn.Module, config: dict[str, Any] | str | Path, group: dist.ProcessGroup | None = None
) -> ZeroEngine:
    """The course's ZeRO built from a DeepSpeed configuration (a dict or a JSON file).

    Supported: `zero_optimization` {`stage` 1-3, `reduce_bucket_size` /
    `allgather_bucket_size` (bytes, or "auto": 25 MiB), `overlap_comm` and
    `contiguous_gradients` (always so here: true only)}, `bf16.enabled` (16-bit compute,
    fp32 masters), `fp16` {`enabled`, `loss_scale` (0: dynamic), `initial_scale_power`,
    `loss_scale_window`, `hysteresis`, `consecutive_hysteresis`, `min_loss_scale`}
    (16-bit compute with DeepSpeed's loss scaling: loss_scale.py),
    `optimizer` {`type` Adam, AdamW or SGD, `params`}, `train_micro_batch_size_per_gpu`,
    `gradient_accumulation_steps`, `train_batch_size` (checked: micro-batch x
    accumulation x ranks; "auto" fills it), `gradient_clipping`;
    beyond stage 3, `offload_optimizer` {`device` none / cpu / nvme, `nvme_path`,
    `pin_memory`} (ZeRO-Offload, ZeRO-Infinity), `offload_param` {`device` none / cpu},
    and ZeRO++'s `zero_quantized_weights`, `zero_hpz_partition_size` (a node's ranks) and
    `zero_quantized_gradients`. With the optimizer offloaded, Adam and AdamW are built
    `fused=True` unless the config says `foreach` or `fused`: their update runs on the host."""
    _, _, world = group_info(group)
    c = check_config(config, world)
    options = dict(c.options)
    path = options.pop("nvme_path", None)
    stage, dtype, kind, params = c.stage, c.dtype, c.optimizer, dict(c.params)
    micro, accumulation, clipping = c.micro, c.accumulation, c.clipping
    module = ZeroModel(model, stage, group, bucket_mb=c.bucket_mb, compute_dtype=dtype, **options)
    if (
        "offload_optimizer" in options
        and kind is not torch.optim.SGD
        and not ({"foreach", "fused"} & set(params))
    ):
        params["fused"] = True  # the update runs on the host: torch's fused CPU Adam is the
        #                         fastest there (DeepSpeed uses its own CPU Adam)
    optimizer: Any = kind([p for p in module.parameters() if p.requires_grad], **params)
    if path is not None:
        optimizer = InfinityOptimizer(module, optimizer, path)
    else:  # whose shard its state is, refused in another rank
        guard_shard_state(optimizer, module)
    return ZeroEngine(
        module,
        optimizer,
        loss_scale=c.loss_scale,
        micro_batch=micro,
        accumulation_steps=accumulation,
        clipping=float(clipping) if clipping is not None else None,
    )


def _section(zero: dict[str, Any], name: str, known: tuple[str, ...]) -> dict[str, Any]:
    section = zero.get(name) or {}
    if not isinstance(section, dict):
        raise ValueError(f"zero_optimization.{name} takes an object, got {section!r}")
    _refuse_unknown(section, known, f"zero_optimization.{name}.")
    if section.get("pin_memory", True) is not True:
        raise ValueError(
            f"zero_optimization.{name}.pin_memory false: host buffers are always "
            "pinned here when the device is a GPU (and there is nothing to pin "
            "without one)"
        )
    return section


def _beyond_stage_3(zero: dict[str, Any], stage: int) -> dict[str, Any]:
    """ZeroModel's options for ZeRO-Offload, ZeRO-Infinity and ZeRO++ (and `nvme_path`)."""
    options: dict[str, Any] = {}
    opt = _section(zero, "offload_optimizer", OFFLOAD_OPTIMIZER_KEYS)
    device = opt.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(
            f"zero_optimization.offload_optimizer.device must be 'none', 'cpu' or "
            f"'nvme', got {device!r}"
        )
    if device == "nvme":
        if not opt.get("nvme_path"):
            raise ValueError(
                "zero_optimization.offload_optimizer.device 'nvme' needs its "
                "nvme_path (a directory for the optimizer's state)"
            )
        options["nvme_path"] = opt["nvme_path"]
    elif "nvme_path" in opt:
        raise ValueError("zero_optimization.offload_optimizer.nvme_path is for device 'nvme'")
    if device != "none":
        options["offload_optimizer"] = "cpu"  # the masters on the host; nvme: state on disk
    param = _section(zero, "offload_param", OFFLOAD_PARAM_KEYS)
    param_device = param.get("device", "none")
    if param_device == "nvme":
        raise ValueError(
            "zero_optimization.offload_param.device 'nvme' (the weights on "
            "disk) is not built here: 'cpu' or 'none'"
        )
    if param_device not in ("none", "cpu"):
        raise ValueError(
            f"zero_optimization.offload_param.device must be 'none' or 'cpu', got {param_device!r}"
        )
    if param_device == "cpu":
        if stage != 3:
            raise ValueError("zero_optimization.offload_param is stage 3's")
        if device == "none":
            raise ValueError(
                "zero_optimization.offload_param needs offload_optimizer on 'cpu' "
                "or 'nvme' too (the weights' shard sits beside the masters)"
            )
        options["offload_params"] = True
    hpz = zero.get("zero_hpz_partition_size", 1)
    if isinstance(hpz, bool) or not isinstance(hpz, int) or hpz < 1:
        raise ValueError(
            f"zero_optimization.zero_hpz_partition_size must be a whole number "
            f">= 1 (a node's ranks), got {hpz!r}"
        )
    plus = {
        "quantized_weights": bool(zero.get("zero_quantized_weights", False)),
        "hpz_partition_size": hpz if hpz > 1 else None,
        "quantized_gradients": bool(zero.get("zero_quantized_gradients", False)),
    }
    if any(plus.values()):
        if stage != 3:
            raise ValueError(
                "ZeRO++ (zero_quantized_weights, zero_hpz_partition_size, "
                f"zero_quantized_gradients) is stage 3's; this is stage {stage}"
            )
        options.update(plus)
    return options
