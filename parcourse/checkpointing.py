"""Activation checkpointing: keep fewer activations in forward, recompute them in backward.

Backward needs what forward computed: each layer saves its inputs (and some
outputs) for its gradient. For n layers that is O(n) memory. Checkpointing
keeps only some tensors and recomputes the rest when backward gets there
(Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174):

- `checkpoint(fn, *args)`: run `fn` without saving anything but its inputs;
  in backward, run it again (with the same random numbers, so dropout draws the
  same masks) and backpropagate through that second run.
- `checkpoint_sequential(layers, segments, x)`: cut a chain of layers into
  segments and checkpoint each: only the segment boundaries stay alive, plus
  one segment's activations while it is being recomputed. With sqrt(n) segments
  of sqrt(n) layers, memory is O(sqrt n) for about one extra forward.
- `recompute_from_input(layers, x)`: the far end of the trade: keep only the
  input; each layer's input is recomputed from the start when its backward
  needs it. O(1) activations, n(n-1)/2 extra layer forwards.

The same recompute-in-backward is what torch.utils.checkpoint does with
use_reentrant=True; torch's default (use_reentrant=False) does it with saved-
tensor hooks instead, which also supports torch.autograd.grad.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

Policy = Literal["none", "sqrt", "every", "nothing"]
POLICIES: tuple[str, ...] = ("none", "sqrt", "every", "nothing")


# --------------------------------------------------------------------------- random numbers


def _devices(tensors: Sequence[torch.Tensor]) -> list[torch.device]:
    return sorted({t.device for t in tensors if t.is_cuda}, key=str)


# Generators of their own that code run under checkpoint may draw from (tensor
# parallelism's dropout keeps two: parcourse.tensor_parallel.random.RNGTracker).
# Recomputation replays them as well, as Megatron's checkpoint replays its RNG tracker.
# Each is held for as long as its owner lives: torch 2.11's generators (seen on a GPU
# machine) cannot be weakly referenced themselves; 2.13's can.
_EXTRA_GENERATORS: weakref.WeakKeyDictionary[Any, list[torch.Generator]] = (
    weakref.WeakKeyDictionary()
)


def replay_generator(generator: torch.Generator, owner: Any = None) -> None:
    """Have every later `checkpoint` replay this generator too when it recomputes, for
    as long as `owner` lives (by default the generator itself, where torch lets a
    generator be weakly referenced; pass the object that keeps it, as `RNGTracker` does)."""
    owner = generator if owner is None else owner
    try:
        held = _EXTRA_GENERATORS.setdefault(owner, [])
    except TypeError:
        raise TypeError(
            f"this {type(owner).__name__} cannot be weakly referenced; pass owner=, the object "
            "whose lifetime the registration should follow"
        ) from None
    if not any(g is generator for g in held):
        held.append(generator)


def _extra_generators() -> list[torch.Generator]:
    return [g for held in list(_EXTRA_GENERATORS.values()) for g in held]


class _RngState:
    """The CPU generator's state, that of every CUDA device the inputs live on, and that of
    every generator registered with `replay_generator`."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.devices = _devices(tensors)
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.extra = [(g, g.get_state()) for g in _extra_generators()]

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Inside, the generators start again from this state; afterwards they are as
        they were before, so recomputing draws nothing from the caller's stream."""
        after = [(g, g.get_state()) for g, _ in self.extra]
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.devices, self.cuda):
                torch.cuda.set_rng_state(state, device)
            for g, state in self.extra:
                g.set_state(state)
            try:
                yield
            finally:
                for g, state in after:
                    g.set_state(state)


def _replay(rng: _RngState | None) -> AbstractContextManager[None]:
    return nullcontext() if rng is None else rng.replay()


def _autocast_now() -> list[tuple[str, dict[str, Any]]]:
    """Autocast as the first run found it, on or off (CPU, and CUDA where there is one):
    the recomputation runs the same, as torch's checkpoint does, whatever region the
    backward is called in; else it would compute in other dtypes than the forward it
    stands in for."""
    devices = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    return [
        (
            d,
            {
                "enabled": torch.is_autocast_enabled(d),
                "dtype": torch.get_autocast_dtype(d),
                "cache_enabled": torch.is_autocast_cache_enabled(),
            },
        )
        for d in devices
    ]


@contextmanager
def _autocast_as(regions: list[tuple[str, dict[str, Any]]]) -> Iterator[None]:
    with ExitStack() as stack:
        for device, kwargs in regions:
            stack.enter_context(torch.autocast(device, **kwargs))
        yield


# --------------------------------------------------------------------------- checkpoint


class _Checkpoint(torch.autograd.Function):
    """forward: run fn under no_grad, save only the tensor inputs.
    backward: run fn again with grad enabled, then backpropagate through it."""

    # Backward gets the gradients in one list that it may empty, so that nothing but the
    # recomputed graph holds them (see backward_taking). A torch older than this attribute
    # (newer than torch 2.6, our oldest) passes them one by one and holds them until
    # backward returns: the same gradients, half a layer output more at the peak of a step.
    boxed_grads_call = True

    @staticmethod
    def forward(ctx: Any, run: _Run, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.run = run
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return run.forward(tensors)

    @staticmethod
    def backward(ctx: Any, *boxed: Any) -> tuple[torch.Tensor | None, ...]:
        grads = boxed[0] if isinstance(boxed[0], list) else list(boxed)
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "parcourse.checkpointing.checkpoint recomputes inside backward(), which "
                "torch.autograd.grad() and backward(inputs=...) do not allow; call "
                "loss.backward(), or use torch.utils.checkpoint(..., use_reentrant=False)"
            )
        run: _Run = ctx.run
        # Fresh leaves: the recomputed graph ends here, and their .grad is what we return.
        # An input without grad is in no graph and goes in as it is (its detached copy
        # would share its memory, but a tracker that has not seen it would count it anew).
        inputs = [t.detach().requires_grad_() if t.requires_grad else t for t in ctx.saved_tensors]
        with torch.enable_grad():
            outputs = run.recompute(inputs)
        # Backpropagate: torch.autograd.backward(outputs, grads), freeing as it goes.
        backward_taking(outputs, grads)
        return (None, *(t.grad if t.requires_grad else None for t in inputs))


class _Seed(torch.autograd.Function):
    """An empty tensor computed from `outputs`; its backward hands each output its
    gradient from the list `grads` and keeps no reference to them."""

    @staticmethod
    def forward(ctx: Any, grads: list[torch.Tensor], *outputs: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return outputs[0].new_empty(0)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads, ctx.grads = ctx.grads, None
        return (None, *grads)


def backward_taking(outputs: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """`torch.autograd.backward(outputs, grads)` for the outputs that carry a gradient
    (several are fine), emptying both lists so that autograd frees each output and each
    gradient once the graph has used it.

    torch.autograd.backward holds the tensors it is given until it returns, so a
    checkpoint's incoming gradient and recomputed output would stay alive through the whole
    segment's backward: two layer outputs more than torch's checkpoint at the peak of a
    step (measured with MemTracker in benchmarks/checkpointing.py). Here backward starts
    from an empty tensor, and the gradients enter the graph through its backward."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
    outputs.clear()
    grads.clear()
    if not pairs:
        return
    with torch.enable_grad():
        seed = _Seed.apply([g for _, g in pairs], *(o for o, _ in pairs))
    del pairs
    torch.autograd.backward(seed, seed.new_empty(0))


class _Run:
    """fn and its arguments, with tensors taken out so autograd sees them as inputs."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        preserve_rng_state: bool,
    ) -> None:
        self.fn = fn
        leaves, self.spec = tree_flatten((args, kwargs))
        self.is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.constants = [None if t else x for x, t in zip(leaves, self.is_tensor)]
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        self.n_tensors = len(tensors)  # the tensors themselves: autograd saves them, and
        # frees them once this segment's backward is done; a reference here would not
        self.rng = _RngState(tensors) if preserve_rng_state else None
        self.autocast = _autocast_now()
        self.out_spec: Any = None
        self.out_constants: list[Any] = []
        self.out_is_tensor: list[bool] = []

    def _call(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        it = iter(tensors)
        leaves = [next(it) if t else c for t, c in zip(self.is_tensor, self.constants)]
        args, kwargs = tree_unflatten(leaves, self.spec)
        out_leaves, self.out_spec = tree_flatten(self.fn(*args, **kwargs))
        return out_leaves

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        leaves = self._call(tensors[: self.n_tensors])
        if not any(isinstance(x, torch.Tensor) for x in leaves):
            raise ValueError(
                "checkpoint: fn returned no tensor, so there is nothing to backpropagate through"
            )
        self.out_is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.out_constants = [None if t else x for x, t in zip(leaves, self.out_is_tensor)]
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def recompute(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with _replay(self.rng), _autocast_as(self.autocast):
            leaves = self._call(tensors[: self.n_tensors])
        return [x for x in leaves if isinstance(x, torch.Tensor)]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if t else c for t, c in zip(self.out_is_tensor, self.out_constants)]
        return tree_unflatten(leaves, self.out_spec)


def checkpoint(
    fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True, **kwargs: Any
) -> Any:
    """`fn(*args, **kwargs)`, keeping only the tensor arguments for backward.

    Arguments and results may be any nesting of tuples, lists and dicts holding
    tensors and other values. Parameters that `fn` uses get their gradients when
    backward recomputes it, as without checkpointing, also when no input requires
    a gradient. With `preserve_rng_state` (default), the recomputation draws the
    same random numbers as the first run, on the CPU and on the inputs' GPUs.
    """
    if not callable(fn):
        raise TypeError(f"checkpoint needs a callable, got {type(fn).__name__}")
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # nothing will be saved anyway
    # An input that requires grad makes autograd call our backward even when fn's own
    # inputs do not (e.g. the first layer's data): its parameters still need gradients.
    anchor = torch.empty(0, requires_grad=True)
    run = _Run(fn, args, kwargs, preserve_rng_state)
    tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    return run.rebuild(_Checkpoint.apply(run, *tensors, anchor))


# --------------------------------------------------------------------------- chains of layers


def segment_count(n_layers: int, segments: int | Literal["sqrt"]) -> int:
    """How many segments: a number from 1 to n_layers, or "sqrt" for ceil(sqrt(n))."""
    if segments == "sqrt":
        return max(1, math.ceil(math.sqrt(n_layers)))
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"segments must be an int or 'sqrt', got {segments!r}")
    if not 1 <= segments <= max(1, n_layers):
        raise ValueError(f"segments must be between 1 and the {n_layers} layers, got {segments}")
    return segments


def run_layers(layers: Sequence[nn.Module], x: Any) -> Any:
    """x through each layer in turn."""
    for layer in layers:
        x = layer(x)
    return x


def checkpoint_sequential(
    layers: Sequence[nn.Module] | nn.Sequential,
    segments: int | Literal["sqrt"],
    input: Any,
    *,
    preserve_rng_state: bool = True,
) -> Any:
    """Run a chain of layers as `segments` checkpointed segments (argument order as
    torch.utils.checkpoint.checkpoint_sequential). Only each segment's input is kept;
    in backward one segment at a time is recomputed. Unlike torch's, the last segment
    is checkpointed too, so every segment costs the same."""
    layers = list(layers)
    if not layers:
        raise ValueError("checkpoint_sequential needs at least one layer")
    k = segment_count(len(layers), segments)
    bounds = [round(i * len(layers) / k) for i in range(k + 1)]
    x = input
    for start, end in zip(bounds, bounds[1:]):
        x = checkpoint(run_layers, layers[start:end], x, preserve_rng_state=preserve_rng_state)
    return x


class _FromInput(torch.autograd.Function):
    """Keep only the chain's input; rebuild each layer's input from it in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        layers: list[nn.Module],
        rng: _RngState | None,
        x: torch.Tensor,
        anchor: torch.Tensor,
    ) -> torch.Tensor:
        ctx.layers, ctx.rng, ctx.autocast = layers, rng, _autocast_now()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_layers(layers, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        layers = ctx.layers
        for i in reversed(range(len(layers))):
            # Layer i's input, rebuilt from the start (i layer forwards, nothing saved),
            # with the random numbers the first run drew up to layer i.
            with _replay(ctx.rng), _autocast_as(ctx.autocast):
                with torch.no_grad():
                    inp = run_layers(layers[:i], x)
                inp = inp.detach().requires_grad_(True)
                with torch.enable_grad():
                    out = layers[i](inp)
            torch.autograd.backward(out, grad)
            grad = inp.grad
        return None, None, grad if x.requires_grad else None, None


def recompute_from_input(
    layers: Sequence[nn.Module] | nn.Sequential,
    input: torch.Tensor,
    *,
    preserve_rng_state: bool = True,
) -> torch.Tensor:
    """Run a chain of layers keeping nothing but `input`: O(1) activation memory, and
    n(n-1)/2 extra layer forwards in backward (layer i's input is rebuilt from the
    start through layers 0..i-1 when its backward needs it)."""
    layers = list(layers)
    if not layers:
        raise ValueError("recompute_from_input needs at least one layer")
    if not isinstance(input, torch.Tensor):
        raise TypeError("recompute_from_input takes one tensor in and one out, layer to layer")
    if not torch.is_grad_enabled():
        return run_layers(layers, input)
    rng = _RngState([input]) if preserve_rng_state else None
    return _FromInput.apply(layers, rng, input, torch.empty(0, requires_grad=True))


def run_with_policy(
    layers: Sequence[nn.Module],
    x: torch.Tensor,
    policy: Policy,
    segments: int | Literal["sqrt"] = "sqrt",
) -> torch.Tensor:
    """A chain of layers under one of the course's policies: "none" keeps everything,
    "sqrt" checkpoints sqrt(n) segments (or `segments`), "every" checkpoints each layer,
    "nothing" keeps only the input."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy == "none":
        return run_layers(layers, x)
    if policy == "every":
        return checkpoint_sequential(layers, len(layers), x)
    if policy == "nothing":
        return recompute_from_input(layers, x)
    return checkpoint_sequential(layers, segments, x)


def recompute_attention(model: nn.Module) -> int:
    """Selective recomputation (Korthikanti et al., arXiv:2205.05198, sec. 5): checkpoint
    only the core of every attention in `model` (scores, softmax, dropout, the weighted
    sum of values), keeping its input q, k, v. Those tensors grow with the square of the
    sequence, and recomputing them costs little next to the layer's matrix multiplies.
    Returns how many attentions it changed."""
    from parcourse.models import CausalSelfAttention

    changed = 0
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            core = type(module).attend.__get__(module)  # the class's own, not a wrapped one
            module.attend = functools.partial(checkpoint, core)  # type: ignore[method-assign]  # this instance's alone, on purpose
            changed += 1
    if not changed:
        raise ValueError("recompute_attention: the model has no CausalSelfAttention")
    return changed
