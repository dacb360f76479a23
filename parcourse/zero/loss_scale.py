"""Loss scaling for fp16, as DeepSpeed's `fp16` section configures it.

fp16's smallest number is 6e-8 and its largest 65504: small gradients become 0. Scaling
the loss by S scales every gradient by S, so that they stay in range; the optimizer
gets them divided by S again. A dynamic scale starts high (2**initial_scale_power) and
halves at each step whose gradients hold an inf or a nan (the step is skipped), and
doubles after `loss_scale_window` steps without one:

    "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}

`loss_scale` 0 is dynamic; a number is a static scale. `hysteresis`: how many overflows
in a row are tolerated (each still skips its step) before the scale halves. The rules are
DeepSpeed's `DynamicLossScaler.update_scale` (deepspeed/runtime/fp16/loss_scaler.py), read
from its source; `docs/zero.md` compares them with torch's `GradScaler`.

Under ZeRO each rank holds its own gradient rows, so whether a step overflowed is the
question every rank answers together: one all-reduce of a flag (`found_inf`), as torch's
`ShardedGradScaler` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

FP16_KEYS = (
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
)


@dataclass
class LossScale:
    """The scale and DeepSpeed's rules for changing it (`update`). `dynamic=False`: a
    static scale, which never changes; an overflow under it is an error (`update`)."""

    scale: float = 2.0**16
    dynamic: bool = True
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    iteration: int = 0
    last_overflow: int = -1
    hysteresis_left: int = field(default=-1)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"the loss scale must be a positive number, got {self.scale}")
        for name in ("window", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if not (math.isfinite(self.min_scale) and self.min_scale > 0):
            raise ValueError(f"min_loss_scale must be a positive number, got {self.min_scale}")
        if self.hysteresis_left < 0:
            self.hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        """After a step: `overflow` if any rank's gradients held an inf or a nan (the step
        was skipped)."""
        if not self.dynamic:
            if overflow:
                raise FloatingPointError(
                    f"an inf or a nan in the gradients under the static loss scale "
                    f"{self.scale:g}: lower fp16.loss_scale, or set it to 0 (dynamic)"
                )
            self.iteration += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale == self.min_scale:
                    raise FloatingPointError(
                        f"the gradients overflow at the smallest loss scale "
                        f"({self.min_scale:g}, fp16.min_loss_scale): the model diverged"
                    )
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= 2
        self.iteration += 1

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> LossScale:
        """From DeepSpeed's `fp16` section (its keys checked by `check_fp16_section`)."""
        static = section.get("loss_scale", 0)
        return cls(
            scale=float(static) if static else 2.0 ** section.get("initial_scale_power", 16),
            dynamic=not static,
            window=section.get("loss_scale_window", 1000),
            hysteresis=section.get("hysteresis", 2),
            consecutive_hysteresis=bool(section.get("consecutive_hysteresis", False)),
            min_scale=float(section.get("min_loss_scale", 1)),
        )


def check_fp16_section(section: Any) -> LossScale | None:
    """DeepSpeed's `fp16` section: None when not enabled, else its `LossScale`. Unknown keys
    and values out of range are refused in one line."""
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"'fp16' takes a section of keys, got {section!r}")
    unknown = set(section) - set(FP16_KEYS)
    if unknown:
        raise ValueError(
            f"unknown key fp16.{sorted(unknown)[0]!r}; supported: {', '.join(FP16_KEYS)}"
        )
    enabled = section.get("enabled", False)
    if enabled == "auto":
        raise ValueError(
            "fp16.enabled 'auto': say true or false (it depends on your GPU, "
            "which this configuration cannot see)"
        )
    if not enabled:
        return None
    static = section.get("loss_scale", 0)
    if isinstance(static, bool) or not isinstance(static, (int, float)) or static < 0:
        raise ValueError(
            f"fp16.loss_scale must be 0 (dynamic) or a positive number, got {static!r}"
        )
    power = section.get("initial_scale_power", 16)
    if isinstance(power, bool) or not isinstance(power, int) or not 0 <= power <= 64:
        raise ValueError(f"fp16.initial_scale_power must be a whole number 0-64, got {power!r}")
    try:
        return LossScale.from_section(section)
    except ValueError as e:
        raise ValueError(f"fp16: {e}") from None


def found_inf(
    grads: Iterable[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device
) -> bool:
    """Whether any rank's `grads` hold an inf or a nan: each rank looks at its own, and one
    all-reduce (MAX) of the flag, on `device` (the group's), tells every rank the same."""
    mine = any(not torch.isfinite(g).all() for g in grads)
    flag = torch.tensor([float(mine)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
