"""FP8: 8-bit floats with their scales, and a Linear layer that computes through them.

The two formats (OCP FP8, as H100 and torch have them):

| format | bits (sign, exponent, mantissa) | largest | smallest normal | eps | used for |
|---|---|---|---|---|---|
| e4m3 (`torch.float8_e4m3fn`) | 1, 4, 3 | 448 | 2**-6 | 2**-3 | weights, activations |
| e5m2 (`torch.float8_e5m2`) | 1, 5, 2 | 57344 | 2**-14 | 2**-2 | gradients (range) |

448 is a narrow range, so a tensor is sent through FP8 with a **scale**: multiplied by
`largest / amax` (its largest magnitude lands on the format's largest), cast, and divided
by the scale again on the way out. One scale for the whole tensor (**tensorwise**), one a
row (**rowwise**, torchao's), or one a block (DeepSeek-V3's 1 x 128 for activations and
128 x 128 for weights): the finer, the less one outlier costs the rest. **Current**
scaling takes amax from the tensor itself; **delayed** scaling (Transformer Engine's) from
the largest of the last steps' (`AmaxHistory`), so that the scale is known before the
tensor is.

`Float8Linear` is `nn.Linear` computing its three matrix multiplies (forward; the input's
and the weight's gradients) on FP8 operands: inputs and weights in e4m3, the output's
gradient in e5m2, the products accumulated in fp32, the weights kept in fp32. Where no
FP8 matrix multiply exists (a CPU), the products run on the dequantised values: each
operand exactly what FP8 hardware would read, the sums in fp32 in another order
(`torch._scaled_mm` on an H100 accumulates in fp32 too). `convert_to_float8(model)` swaps
a model's Linear layers for it, as torchao's `convert_to_float8_training` does.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

Format = Literal["e4m3", "e5m2"]
Granularity = Literal["tensor", "row", "block"]
FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

__all__ = [
    "FORMATS",
    "AmaxHistory",
    "Float8Linear",
    "Recipe",
    "Scaled",
    "convert_to_float8",
    "dequantize",
    "error_bound",
    "quantize",
    "relative_error",
    "scale_for",
]


def _dtype(fmt: str) -> torch.dtype:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


@dataclass(frozen=True)
class Scaled:
    """A tensor in FP8 and its scales: `data` (the FP8 values, the tensor's shape) and
    `scale` (fp32: one, one a row, or one a block), `data / scale` the values it holds."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: Granularity
    block: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Bytes it takes to hold or send: one a value, four a scale."""
        return self.data.numel() + 4 * self.scale.numel()


def _groups(x: torch.Tensor, granularity: str, block: tuple[int, int]) -> torch.Tensor:
    """`x` (2-D) as (groups, values of a group), zero-padded to whole blocks."""
    rows, cols = x.shape
    if granularity == "tensor":
        return x.reshape(1, -1)
    if granularity == "row":
        return x
    br, bc = block
    pad_r, pad_c = -rows % br, -cols % bc
    padded = nn.functional.pad(x, (0, pad_c, 0, pad_r))
    r, c = padded.shape
    return padded.reshape(r // br, br, c // bc, bc).permute(0, 2, 1, 3).reshape(-1, br * bc)


def _expand(scale: torch.Tensor, shape: torch.Size, granularity: str, block: tuple[int, int]):
    """Each value's scale, in `shape`."""
    rows, cols = shape
    if granularity == "tensor":
        return scale.reshape(1, 1).expand(rows, cols)
    if granularity == "row":
        return scale.reshape(rows, 1).expand(rows, cols)
    br, bc = block
    per_block = scale.reshape(-(-rows // br), -(-cols // bc))
    return per_block.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]


def scale_for(amax: torch.Tensor, fmt: Format = "e4m3") -> torch.Tensor:
    """The scale that puts `amax` on the format's largest value (1 where amax is 0)."""
    largest = torch.finfo(_dtype(fmt)).max
    amax = amax.float()
    return torch.where(amax > 0, largest / amax, torch.ones_like(amax))


def quantize(
    x: torch.Tensor,
    fmt: Format = "e4m3",
    granularity: Granularity = "tensor",
    block: tuple[int, int] = (1, 128),
    scale: torch.Tensor | None = None,
) -> Scaled:
    """`x` (1-D or 2-D) in FP8 `fmt` with scales by `granularity`: "tensor", "row" or
    "block" (`block` = (rows, cols) of a block, e.g. (1, 128) or (128, 128)). `scale`: a
    tensorwise scale given beforehand (delayed scaling, `AmaxHistory.scale`); a value
    beyond the format's range after it is clamped to the largest, as hardware saturates."""
    dtype = _dtype(fmt)
    if granularity not in ("tensor", "row", "block"):
        raise ValueError(f"granularity must be tensor, row or block, got {granularity!r}")
    if not (len(block) == 2 and all(isinstance(b, int) and b >= 1 for b in block)):
        raise ValueError(f"block must be two whole numbers >= 1, got {block!r}")
    if x.dim() not in (1, 2):
        raise ValueError(f"quantize takes a 1-D or 2-D tensor, got {x.dim()}-D")
    if scale is not None and granularity != "tensor":
        raise ValueError("a given scale is a tensor's: granularity must be 'tensor'")
    flat = x.detach().float()
    two_d = flat.reshape(1, -1) if flat.dim() == 1 else flat
    if scale is None:
        scale = scale_for(_groups(two_d, granularity, block).abs().amax(dim=1), fmt)
    scale = scale.float().reshape(-1)
    largest = torch.finfo(dtype).max
    each = _expand(scale, two_d.shape, granularity, block)
    data = (two_d * each).clamp(-largest, largest).to(dtype).reshape(x.shape)
    return Scaled(data, scale, granularity, tuple(block))  # type: ignore[arg-type]


def dequantize(q: Scaled) -> torch.Tensor:
    """The fp32 values `q` holds."""
    values = q.data.float()
    two_d = values.reshape(1, -1) if values.dim() == 1 else values
    each = _expand(q.scale, two_d.shape, q.granularity, q.block)
    return (two_d / each).reshape(q.data.shape)


def error_bound(q: Scaled, fmt: Format) -> torch.Tensor:
    """How far each value of `dequantize(q)` may lie from the value quantised (where it
    was in range): half a spacing of the format at the value, eps/2 x |value| for normals
    and half the subnormal spacing (the smallest normal x eps) below, divided by the
    value's scale."""
    info = torch.finfo(_dtype(fmt))
    values = q.data.float().abs()
    two_d = values.reshape(1, -1) if values.dim() == 1 else values
    each = _expand(q.scale, two_d.shape, q.granularity, q.block)
    normal = info.eps / 2 * two_d
    below = info.smallest_normal * info.eps / 2
    return (torch.clamp(normal, min=below) / each).reshape(q.data.shape)


class AmaxHistory:
    """Delayed scaling: the amaxes of the last `length` tensors seen, the scale from the
    largest of them (Transformer Engine's "max" algorithm). `scale()` before the tensor,
    `record(x)` after."""

    def __init__(self, length: int = 16, fmt: Format = "e4m3") -> None:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"length must be a whole number >= 1, got {length!r}")
        self.fmt = fmt
        _dtype(fmt)
        self.amaxes: deque[float] = deque(maxlen=length)

    def scale(self) -> torch.Tensor:
        """The scale for the next tensor: from the history's largest amax (1 if empty)."""
        amax = max(self.amaxes, default=0.0)
        return scale_for(torch.tensor([amax]), self.fmt)

    def record(self, x: torch.Tensor) -> None:
        self.amaxes.append(float(x.detach().abs().max()) if x.numel() else 0.0)


@dataclass(frozen=True)
class Recipe:
    """How `Float8Linear` scales: `granularity` and `block` for its inputs and the
    output's gradient; its weight's blocks are square (`block`'s larger side), as
    DeepSeek-V3's 1 x 128 activations beside 128 x 128 weights."""

    granularity: Granularity = "tensor"
    block: tuple[int, int] = (1, 128)

    def __post_init__(self) -> None:
        quantize(torch.zeros(1, 1), "e4m3", self.granularity, self.block)  # checks both


def _fp8(x: torch.Tensor, fmt: Format, recipe: Recipe, block: tuple[int, int] | None = None):
    """`x` (2-D) through FP8 and back: what an FP8 matrix multiply reads."""
    return dequantize(quantize(x, fmt, recipe.granularity, block or recipe.block))


class _Float8Matmuls(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq = _fp8(x2, "e4m3", recipe)
        wq = _fp8(weight, "e4m3", recipe, _square(recipe))
        ctx.save_for_backward(xq, wq)
        ctx.recipe, ctx.shape = recipe, x.shape
        return (xq @ wq.t()).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        xq, wq = ctx.saved_tensors
        recipe = ctx.recipe
        gq = _fp8(grad.reshape(-1, grad.shape[-1]).float(), "e5m2", recipe)
        grad_x = (gq @ wq).reshape(ctx.shape)  # dX = dY W
        grad_w = gq.t() @ xq  # dW = dY^T X: the sums run over the tokens
        return grad_x, grad_w, None


def _square(recipe: Recipe) -> tuple[int, int]:
    """A weight's blocks under the block recipe: square (DeepSeek-V3's 128 x 128)."""
    side = max(recipe.block)
    return (side, side)


class Float8Linear(nn.Linear):
    """`nn.Linear` whose matrix multiplies read FP8 operands (module docstring): weights
    and bias kept in fp32, the bias added in fp32. `recipe`: how it scales (`Recipe`)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, recipe: Recipe | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias)
        self.recipe = recipe or Recipe()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe | None = None) -> Float8Linear:
        """The same weights (shared, not copied) in a Float8Linear."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.recipe = recipe or Recipe()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Float8Matmuls.apply(x.float(), self.weight, self.recipe)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.granularity}"


def convert_to_float8(model: nn.Module, recipe: Recipe | None = None) -> nn.Module:
    """Every `nn.Linear` of `model` swapped, in place, for a `Float8Linear` holding its
    weights (as torchao's `convert_to_float8_training`); returns the model."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and not isinstance(child, Float8Linear):
            setattr(model, name, Float8Linear.from_linear(child, recipe))
        else:
            convert_to_float8(child, recipe)
    return model


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (norms): how far a low-precision result is from fp32's."""
    got, want = got.detach(), want.detach()
    return float((got - want).norm() / want.norm().clamp_min(math.ulp(0.0)))
