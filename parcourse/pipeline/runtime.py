"""One runtime that executes any schedule on real ranks.

Each rank holds the stages the schedule puts on it and runs its actions in
order. A forward receives its input from the previous stage (point to point),
runs the stage and sends the output on; a backward receives the gradient of
that output, backpropagates through the saved graph, sends the gradient of the
input back and frees the microbatch's activations. The loss of each microbatch
is divided by the number of microbatches, so the gradients add up to those of
one process on the whole batch when the loss is a mean over its rows (as torch's
schedules do with scale_grads; a loss with reduction="sum" comes out 1/m of one
process's, and so do its gradients); the caller steps the optimizer afterwards.
Gradients accumulate over steps until the caller zeroes them, as with backward().
A step always runs backward: there is no forward-only (evaluation) step.

Messages go through a `parcourse.comm.Comm` (`send`, `recv`): bytes counted on the
tracer, a simulated link when one is given, CUDA tensors staged through host
memory when the backend (gloo) cannot send them. `SimulatedCompute` (the
simulator's cost model) makes every action last a fixed time per stage (the real
math runs, then the rank waits out the rest), so that ranks sharing a few cores
behave as separate devices would. Which message an action waits for and sends is
the rule in `actions` (`incoming`, `outgoing`); when receives are posted, the policy
in `posting`.

One file because each part serves the one `step`: read `PipelineRuntime` top down
(point to point, shapes agreed once, the step with its overlapped pairs, then the four
kinds of action), then the helpers at the end: the checks of what the constructor is
given, each action's simulated seconds, and each stage's neighbours. The gradients that
ranks add up after the schedule (tied weights, DualPipe's copies) are `tied.py`'s; the
turns that overlapped pairs take on the device are `comm/turns.py`'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from parcourse.checkpointing import checkpoint
from parcourse.comm import Comm, SimulatedLink
from parcourse.comm.common import backend_for
from parcourse.comm.messenger import Arrival
from parcourse.comm.pacing import Pacer
from parcourse.comm.turns import Turns, in_lane
from parcourse.memory import PeakSavedBytes, SavedActivations, live_bytes
from parcourse.pipeline.actions import Action, Message, Schedule, check, incoming, outgoing
from parcourse.pipeline.posting import early_receives
from parcourse.pipeline.simulate import SimulatedCompute
from parcourse.pipeline.split import WeightGradient, input_gradient
from parcourse.pipeline.tied import SharedGradients, gradient_groups
from parcourse.trace import Tracer

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _tag(kind: str, stage: int, microbatch: int, microbatches: int, stages: int) -> int:
    """A tag per message: what it carries (F: activations, B: gradients, S: a shape,
    T: a tied weight's gradient)."""
    return (("FBST".index(kind) * stages + stage) * microbatches + microbatch) + 1


class PipelineRuntime:
    """`PipelineRuntime(schedule, stages, group, loss_fn)`: `stages` maps each stage this
    rank holds (as `schedule.stage_rank` says) to its module. `recompute=True` checkpoints
    each stage's forward (GPipe with re-materialization): a microbatch in flight holds
    only its input, and backward runs the stage's forward again.

    `step(inputs, targets)` runs one schedule: rank of stage 0 passes the batch, rank
    of the last stage the targets; it returns the mean loss there (None elsewhere).
    `prepare(inputs)` does beforehand what a first step does first (the stages agree on
    their messages' shapes), so that a first step timed after it is the schedule's alone.

    `tied` lists weights that several stages share, each as {stage: parameter name in
    that stage's module}: a GPT's token embedding (stage 0) and its LM head (the last
    stage). After the schedule, the ranks that hold a tied weight add up its gradient
    (in rank order, so every copy gets the same bits), as Megatron-LM's embedding group
    does; with the same start and the same optimizer, the copies stay equal.

    `comm`: the `Comm` messages go through (its group, tracer and link); without one,
    one is made from `group`, `tracer` and `link`. With both, `tracer` records the
    runtime's own spans and the Comm's tracer its messages.

    `on_weight_gradients(stage, microbatch)`: called after each action that adds a
    microbatch's gradients to a stage's weights (B, or W when the backward is split), so
    that a caller can take them away at once (ZeRO-2 over data parallelism does).

    `paced`: with simulated `compute`, the `Comm` whose blocking collectives run inside
    the actions (tensor parallelism's): their seconds are not compute and come on top of
    the padding, which `comm.pacing.Pacer` spreads over the action so that a group meets
    at each collective together.

    `around(action)`: a context each action runs in, its message received and sent
    inside it: ZeRO-3 over data parallelism gathers the stage's weights before and frees
    them after (`Hybrid(zero=3)`).

    `together()`: a context each W runs in, whose backward calls (one per group of
    weights) then count as one backward: `Hybrid` gives sequence parallelism's
    `one_sum`, so that a W sums the replicated gradients once, as a whole B does.

    `turns`: the rank's device (`comm.turns.Turns`). Every action computes holding it and
    hands it on while it waits for a message; the pairs the schedule means to overlap
    (`schedule.together`, DualPipe's forward of one microbatch beside the backward of
    another) run at once, in two threads taking turns, so that one's all-to-all (a `Comm`
    given the same turns: the experts' ep group's) runs while the other computes. What was
    hidden is in the turns' record after the step (`Turns.exposed`). The two threads
    share the rank, so what runs inside their actions must be compute and messages of
    their own (send / recv, the all-to-all): with pairs, `around`,
    `on_weight_gradients` and `together` are refused (their collectives belong to the
    whole rank). Without pairs (1F1B), the turns only keep the record. With simulated
    `compute`, each action's seconds are padded piece by piece between its waits
    (`Turns.paced`), so that the device is busy for them whichever thread holds it. The
    threads inherit the step's autocast, not its other thread-local settings (saved-tensor
    hooks such as `save_on_cpu` stay with the step's thread). Stages on CPU only: on a GPU,
    autograd runs backward on a thread of its own for the device, out of the turns. A
    pair's two compute spans on the tracer each run from the action's start to its end,
    waits included, so they overlap: the device's own time is the turns' record.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: dict[int, nn.Module],
        group: dist.ProcessGroup | None,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        tracer: Tracer | None = None,
        link: SimulatedLink | None = None,
        compute: SimulatedCompute | None = None,
        recompute: bool = False,
        tied: Sequence[dict[int, str]] = (),
        comm: Comm | None = None,
        on_weight_gradients: Callable[[int, int], None] | None = None,
        paced: Comm | None = None,
        together: Callable[[], AbstractContextManager[Any]] | None = None,
        around: Callable[[Action], AbstractContextManager[Any]] | None = None,
        turns: Turns | None = None,
    ) -> None:
        check(schedule)
        _refuse_combinations(
            schedule,
            recompute=recompute,
            paced=paced,
            turns=turns,
            rank_wide={
                "around": around,
                "on_weight_gradients": on_weight_gradients,
                "together": together,
            },
        )
        if comm is None:
            comm = Comm(group, tracer=tracer, link=link, algorithm="auto")
        elif link is not None:
            raise ValueError("give the link to the Comm, not to the runtime")
        self.comm = comm
        self.group, self.rank, self.world_size = comm.group, comm.rank, comm.size
        _check_stages(schedule, stages, tied, self.rank, self.world_size)
        self.schedule, self.stages, self.loss_fn = schedule, stages, loss_fn
        # (tag, {stage: parameter name}): the weights whose gradients ranks add up.
        self.tied = gradient_groups(schedule, stages, tied)
        self._shared = SharedGradients(self.tied, stages, self.rank, self._peer)
        self._loss_tag = len(tied)  # the one offset among the tied groups' tags left free
        # The runtime's own spans (F, B, I, W, waits) go to `tracer`, its messages to the
        # Comm's (the same one unless told otherwise).
        self.tracer = tracer if tracer is not None else comm.tracer
        self.link, self.compute = comm.link, compute
        # only with simulated compute: padding is what the pacer paces (wired into every
        # collective of `paced`, it would be a call per collective for nothing otherwise)
        self._pacer = Pacer(paced) if compute is not None else None
        self._seconds = _simulated_seconds(schedule, compute)
        self.recompute = recompute  # GPipe's own trick: keep a stage's input, not its insides
        # This rank's stage where microbatches enter (None: none), and whether it takes a loss
        self._entry = min(schedule.entry_stages & set(stages), default=None)
        self._has_last = bool(schedule.exit_stages & set(stages))
        self._before, self._after = _neighbours(schedule)
        self._shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}  # each stage's input
        self._out_shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}  # ... and output
        # Which receives go early depends on the backend that carries the stages' tensors,
        # known at `prepare` (the model may move after it was wrapped): decided there,
        # again only if the stages have moved to another device.
        self._posts: dict[int, list[Action]] = {}
        self._posts_device: torch.device | None = None
        self._failed: str | None = None
        self.on_weight_gradients = on_weight_gradients
        self._together = together
        self._around = around
        self.turns = turns
        # the forward each overlapped backward runs beside (none without turns)
        self._pairs = dict(schedule.together) if turns is not None else {}
        # of the last step, when a tracer measures them: the activations held for the
        # microbatches in flight, and under recompute those a backward rebuilds beside them
        self.peak_in_flight_bytes = 0

    # -- point to point

    def _peer(self, stage: int) -> int:
        return self.schedule.stage_rank[stage]

    def _send(self, message: Message, t: torch.Tensor) -> None:
        """Activations of a stage (kind F) or the gradient of its input (kind B)."""
        if self._peer(message.to) == self.rank:
            self._local[message] = t
            return
        kind, stage, microbatch, _ = message
        tag = _tag(kind, stage, microbatch, self.schedule.microbatches, self.schedule.stages)
        t = t.detach().contiguous()
        self._sends.append((self.comm.send(t, self._peer(message.to), tag), t))

    def _incoming(self, a: Action) -> Message | None:
        return incoming(a, self.schedule)

    def _post(self, a: Action) -> None:
        """Post the receive `a` needs (a buffer of the agreed shape), once."""
        need = self._incoming(a)
        if need is None or a in self._posted or self._peer(need.stage) == self.rank:
            return
        kind, stage = need.kind, need.stage
        shape, dtype = self._shapes[a.stage] if kind == "F" else self._out_shape(a.stage)
        tag = _tag(kind, stage, a.microbatch, self.schedule.microbatches, self.schedule.stages)
        buffer = torch.empty(shape, dtype=dtype, device=self._device)
        self._posted[a] = (self.comm.recv(buffer, self._peer(stage), tag), buffer)

    def _receive(self, a: Action) -> torch.Tensor | None:
        """What `a` needs from another stage (activations for F, the gradient of the
        output for B and I), posted earlier (see `posting.receives_to_post`) or now, and
        waited for in a comm span named after it."""
        need = self._incoming(a)
        if need is None:
            return None
        kind, stage = need.kind, need.stage
        if self._peer(stage) == self.rank:
            return self._local.pop(need)
        self._post(a)
        work, buffer = self._posted.pop(a)
        start = time.perf_counter_ns()
        with self.turns.handed_on("receive") if self.turns is not None else nullcontext():
            work.wait()
        if self.comm.tracer is not None:
            departed = work.departed if isinstance(work, Arrival) else None
            self._trace_receive(
                f"{stage}{kind}{a.microbatch}",
                start,
                time.perf_counter_ns(),
                departed,
                buffer.nbytes,
            )
        return buffer

    def _trace_receive(
        self, name: str, start: int, end: int, departed: float | None, nbytes: int
    ) -> None:
        """A receive waited for from `start` to `end`: from when the message left its
        sender (`departed`, which the messenger knows over a simulated link; on a real
        one, nothing the rank can see) it is communication; before that, waiting for
        the other rank to get there, idle, the bubble, drawn as such. Neither has a
        `microbatch` key, so a timeline coloured by microbatch does not take them for
        compute."""
        tracer = self.comm.tracer
        assert tracer is not None
        split = end if departed is None else min(end, max(start, int(departed * 1e9)))
        if split > start:
            tracer.add_span(f"wait for {name}", start, split, kind="idle", bytes=nbytes)
        tracer.add_span(f"receive {name}", split, end, kind="comm", bytes=nbytes)

    def _agree_on_shapes(
        self, example: torch.Tensor | None
    ) -> dict[int, tuple[torch.Size, torch.dtype]]:
        """Before the first step: each stage learns its input's shape from the previous one
        (shapes found on the meta device, no math), so receives can be posted. Returns
        each of this rank's stages' input shape and dtype."""
        # In the order of the routes, so that no rank waits for a shape not yet sent; the
        # sends are waited for at the end (DualPipe's two directions cross).
        sends: list[tuple[Any, torch.Tensor]] = []
        shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}
        for s in sorted(self.stages, key=lambda t: (_depth(self._before, t), t)):
            before, after = self._before[s], self._after[s]
            if before is None:
                assert example is not None
                shape, dtype = example.shape, example.dtype
            elif self._peer(before) == self.rank:
                shape, dtype = self._out_shape(before, shapes)
            else:
                header = torch.zeros(10, dtype=torch.int64)
                self.group.recv(
                    [header], self._peer(before), _tag("S", before, 0, 1, self.schedule.stages)
                ).wait()
                ndim = int(header[0])
                shape, dtype = torch.Size(header[2 : 2 + ndim].tolist()), _DTYPES[int(header[1])]
            shapes[s] = (shape, dtype)
            if after is not None and self._peer(after) != self.rank:
                out, out_dtype = self._out_shape(s, shapes)
                header = torch.zeros(10, dtype=torch.int64)
                header[0], header[1] = len(out), _DTYPES.index(out_dtype)
                header[2 : 2 + len(out)] = torch.tensor(list(out))
                sends.append(
                    (
                        self.group.send(
                            [header], self._peer(after), _tag("S", s, 0, 1, self.schedule.stages)
                        ),
                        header,
                    )
                )
        for work, _ in sends:
            work.wait()
        return shapes

    def _out_shape(
        self, stage: int, inputs: dict[int, tuple[torch.Size, torch.dtype]] | None = None
    ) -> tuple[torch.Size, torch.dtype]:
        """The shape and dtype of `stage`'s output, found once on the meta device from its
        input's (in `inputs`, else as agreed)."""
        if stage not in self._out_shapes:
            shape, dtype = (self._shapes if inputs is None else inputs)[stage]
            module = self.stages[stage]
            meta = {
                n: torch.empty_like(t, device="meta")
                for n, t in [*module.named_parameters(), *module.named_buffers()]
            }
            out = functional_call(module, meta, (torch.empty(shape, dtype=dtype, device="meta"),))
            self._out_shapes[stage] = (out.shape, out.dtype)
        return self._out_shapes[stage]

    # -- the step

    def step(self, inputs: torch.Tensor | None = None, targets: Any = None) -> float | None:
        """Run the schedule once over `inputs` cut into microbatches: the ranks where
        microbatches enter (stage 0's; DualPipe's two ends) pass the batch's inputs, the
        ranks where their loss is taken the targets. Returns the mean loss over the whole
        batch on those ranks (None elsewhere)."""
        self._refuse_if_failed()
        m, has_first, has_last = (
            self.schedule.microbatches,
            self._entry is not None,
            self._has_last,
        )
        self._check_batch(inputs, targets, with_targets=True)
        self._prepare(inputs)
        # Each microbatch its own storage: saved for backward (the loss saves its
        # targets), it counts as one microbatch's bytes, not the whole batch's.
        self._inputs = (
            [c.clone() for c in inputs.chunk(m)] if has_first and inputs is not None else []
        )
        self._targets = [c.clone() for c in targets.chunk(m)] if has_last else []
        self._local: dict[Message, torch.Tensor] = {}
        self._saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._later: dict[tuple[int, int], tuple[WeightGradient, int]] = {}
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self._in_flight_bytes = self.peak_in_flight_bytes = 0
        self._losses: list[float] = []
        self._posted: dict[Action, tuple[Any, torch.Tensor]] = {}
        self._shared.remember()  # what the tied weights' gradients held before this step
        if self.turns is not None:
            self.turns.clear()
        actions = self.schedule.actions[self.rank]
        k = 0
        while k < len(actions):
            action = actions[k]
            partner = self._pairs.get(action)
            if partner is not None and (k + 1 == len(actions) or actions[k + 1] != partner):
                partner = None  # not right after it: run them apart
            for j in range(k, k + (1 if partner is None else 2)):
                for later in self._posts.get(j, ()):
                    self._post(later)
            if partner is None:
                self._act(action)
            else:
                self._overlapped(action, partner)
            k += 1 if partner is None else 2
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self._shared.add_up(self.comm, _tag("T", 0, 0, m, self.schedule.stages))
        return self._whole_loss(sum(self._losses)) if has_last else None

    def _act(self, action: Action) -> None:
        """Run one action (holding the rank's turn, with turns), its context around it."""
        try:
            with self.turns.held(action) if self.turns is not None else nullcontext():
                with self._around(action) if self._around is not None else nullcontext():
                    self._run(action)
            if self.on_weight_gradients is not None and action.kind in ("B", "W"):
                self.on_weight_gradients(action.stage, action.microbatch)
        except Exception as e:
            self._failed = f"at {action}"
            raise RuntimeError(
                f"rank {self.rank} failed at {action}: {type(e).__name__}: {e}"
            ) from e

    def _overlapped(self, forward: Action, backward: Action) -> None:
        """A pair the schedule overlaps: the forward in lane 1, the backward in lane 2, two
        threads taking the rank's turns. Raises the first failure at once (the other
        thread may wait for a message that will never come: a daemon, it does not keep
        the process alive)."""
        device = self._device.type
        autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        failed: list[BaseException] = []

        def run(action: Action, number: int) -> None:
            try:  # autocast is per thread: as the step's caller set it
                with (
                    in_lane(number),
                    torch.autocast(device, dtype=autocast[1], enabled=autocast[0]),
                ):
                    self._act(action)
            except BaseException as e:  # noqa: BLE001 -- raised again by the step's thread
                failed.append(e)

        threads = [
            threading.Thread(target=run, args=(a, n), daemon=True, name=f"rank {self.rank} {a}")
            for n, a in ((1, forward), (2, backward))
        ]
        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads) and not failed:
                for t in threads:
                    t.join(0.05)
        except BaseException:  # interrupted: the threads may still run; no step after this
            self._failed = f"interrupted at {forward} beside {backward}"
            raise
        if failed:
            raise failed[0]

    def _refuse_if_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError(
                f"an earlier step failed on rank {self.rank} ({self._failed}); "
                "its messages may still be in flight: build a new "
                "PipelineRuntime (and process group) rather than step again"
            )

    def _check_batch(self, inputs: torch.Tensor | None, targets: Any, with_targets: bool) -> None:
        """Raises unless this rank has the inputs (if microbatches enter here) and, with
        `with_targets`, the targets (if their loss is taken here) that it needs, each a
        batch that the microbatches divide."""
        m, has_first = self.schedule.microbatches, self._entry is not None
        has_last = self._has_last and with_targets
        if has_first and inputs is None:
            raise ValueError(
                f"rank {self.rank} holds a stage where microbatches enter: pass the batch's inputs"
            )
        if has_last and targets is None:
            raise ValueError(f"rank {self.rank} holds the last stage: pass the targets")
        for name, batch in (
            ("inputs", inputs if has_first else None),
            ("targets", targets if has_last else None),
        ):
            if batch is not None and batch.shape[0] % m:
                raise ValueError(
                    f"{m} microbatches do not divide the batch of {batch.shape[0]} {name}"
                )

    def prepare(self, inputs: torch.Tensor | None = None) -> None:
        """Before the first step, what it would do first: the stages agree on the shapes
        and dtypes they send each other, and the receives to post early are chosen for
        the stages' device. Every rank of the pipeline calls it; those where microbatches
        enter pass a batch of the steps' shape. Optional (`step` does it when needed),
        but call it before timing a first step: agreeing passes a message from each stage
        to the next in turn, after a meta-device forward of the stage, so it starts each
        rank later than the one before it (tens of ms on shared cores) and the step's
        time and bubble are no longer the schedule's. Shapes and dtypes stay fixed after,
        as with torch's PipelineStage: cast the stages before calling it (moving them to
        another device later is fine)."""
        self._refuse_if_failed()
        self._check_batch(inputs, None, with_targets=False)
        self._prepare(inputs)

    def _prepare(self, inputs: torch.Tensor | None) -> None:
        """`prepare` on a checked batch (`step` has checked it already)."""
        m = self.schedule.microbatches
        self._device = next(next(iter(self.stages.values())).parameters()).device
        if self.turns is not None and self._device.type != "cpu":
            raise ValueError(
                f"turns take a rank's threads in turns on CPU stages; these are on "
                f"{self._device}, where autograd runs backward on a thread of "
                "its own (out of the turns): run without turns"
            )
        if self._posts_device != self._device:
            self._posts = early_receives(
                self.schedule, self.rank, backend_for(self.group, self._device)
            )
            self._posts_device = self._device
        entry = self._entry
        first = inputs[: inputs.shape[0] // m] if entry is not None and inputs is not None else None
        if not self._shapes:
            try:
                self._shapes = self._agree_on_shapes(first)
            except Exception as e:  # the other ranks may wait for a shape never sent
                self._failed = f"agreeing on shapes: {type(e).__name__}: {e}"
                raise
        elif first is not None and entry is not None:
            agreed = self._shapes[entry][0]
            if first.shape != agreed:
                raise ValueError(
                    f"microbatches of shape {tuple(first.shape)}, but this "
                    f"pipeline agreed on {tuple(agreed)} (at prepare or its "
                    "first step): build a new PipelineRuntime for another shape"
                )

    def _whole_loss(self, mine: float) -> float:
        """Where several ranks take losses (DualPipe: one for each direction), each has
        its microbatches' part: add them up, so every one of them returns the batch's."""
        ranks = sorted(self.schedule.exit_ranks)
        if len(ranks) < 2:
            return mine
        tag = _tag("T", 0, 0, self.schedule.microbatches, self.schedule.stages) + self._loss_tag
        local = torch.tensor([mine], dtype=torch.float64)
        sends = [self.comm.send(local, r, tag) for r in ranks if r != self.rank]
        total = 0.0
        for r in ranks:
            if r == self.rank:
                total += mine
            else:
                part = torch.empty(1, dtype=torch.float64)
                self.comm.recv(part, r, tag).wait()
                total += float(part)
        for w in sends:
            w.wait()
        return total

    def _run(self, a: Action) -> None:
        """Receive what the action needs (a comm span), compute (a compute span, padded
        to its simulated time), send what it made."""
        s, i = a.stage, a.microbatch
        received = self._receive(a)
        with (
            self.tracer.span(str(a), kind="compute", stage=s, microbatch=i, action=a.kind)
            if self.tracer is not None
            else nullcontext()
        ):
            # Padded inside the span: a collective's paced share counts from its start.
            with self._padded(a):
                run: dict[str, Callable[[Action, torch.Tensor | None], torch.Tensor | None]]
                run = {
                    "F": self._forward,
                    "B": self._backward,
                    "I": self._input_gradient,
                    "W": self._weight_gradient,
                }
                out = run[a.kind](a, received)
        message = outgoing(a, self.schedule)
        if message is not None:
            assert out is not None, f"{a} made nothing to send"
            self._send(message, out)

    def _padded(self, a: Action) -> AbstractContextManager[Any]:
        """An action's simulated seconds: by the pacer (collectives on top), or with turns
        piece by piece between its waits (nothing without simulated compute)."""
        if self._seconds is None:
            return nullcontext()
        seconds = self._seconds[a.kind][a.stage]
        if self.turns is not None:
            return self.turns.paced((a.stage, a.kind), seconds)
        assert self._pacer is not None
        return self._pacer.padded((a.stage, a.kind), seconds)

    def _forward(self, a: Action, received: torch.Tensor | None) -> torch.Tensor:
        """Run the stage; keep its input, output and graph until the backward."""
        s, i = a.stage, a.microbatch
        x = self._inputs[i] if received is None else received.detach().requires_grad_(True)
        acts = SavedActivations() if self.tracer is not None else None  # measuring only
        with acts if acts is not None else nullcontext():
            y = checkpoint(self.stages[s], x) if self.recompute else self.stages[s](x)
            if self.schedule.next_stage(s, i) is None:  # the loss, scaled so that the
                #                        microbatches add up to the whole batch's mean
                y = self.loss_fn(y, self._targets[i]) / self.schedule.microbatches
                self._losses.append(float(y.detach()))
        held = live_bytes(self.stages[s], activations=acts)["activations"] if acts else 0
        self._saved[(s, i)] = (x, y, held)
        self._count_in_flight(held, a)
        return y

    def _backward(self, a: Action, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Backpropagate through the saved graph and free it; the input's gradient.
        Recomputed and measured: what the stage's forward saves again while its backward
        runs (the microbatch's input, already counted, excepted) adds to what is held."""
        x, y, held = self._saved.pop((a.stage, a.microbatch))
        rebuilt = (
            PeakSavedBytes(exclude=[*self.stages[a.stage].parameters(), x])
            if self.recompute and self.tracer is not None
            else None
        )
        with rebuilt if rebuilt is not None else nullcontext():
            torch.autograd.backward(y, grad)  # grad None: y is the last stage's loss
        if rebuilt is not None:
            self.peak_in_flight_bytes = max(
                self.peak_in_flight_bytes, self._in_flight_bytes + rebuilt.peak
            )
        del y  # the graph, and the activations it saved, go here
        self._count_in_flight(-held, a)
        return x.grad

    def _input_gradient(self, a: Action, grad: torch.Tensor | None) -> torch.Tensor | None:
        """I: the gradient of the stage's input only; what W needs stays until W."""
        x, y, held = self._saved.pop((a.stage, a.microbatch))
        dx, later = input_gradient(y, grad, x, list(self.stages[a.stage].parameters()))
        del y  # the part of the graph W does not need goes here
        self._later[(a.stage, a.microbatch)] = (later, held)
        return dx

    def _weight_gradient(self, a: Action, _: torch.Tensor | None) -> None:
        """W: the weights' gradients, accumulated into .grad; then the graph goes."""
        later, held = self._later.pop((a.stage, a.microbatch))
        with self._together() if self._together is not None else nullcontext():
            later()
        self._count_in_flight(-held, a)

    def _count_in_flight(self, delta: int, action: Action) -> None:
        self._in_flight_bytes += delta
        self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, self._in_flight_bytes)
        if self.tracer is not None:
            self.tracer.count(
                "in_flight_bytes",
                delta,
                now=self._in_flight_bytes,
                stage=action.stage,
                microbatch=action.microbatch,
            )


def _refuse_combinations(
    schedule: Schedule,
    *,
    recompute: bool,
    paced: Comm | None,
    turns: Turns | None,
    rank_wide: dict[str, object | None],
) -> None:
    """Raises for the options that cannot go together: turns with a pacer, turns with
    overlapped pairs and any of `rank_wide` (options whose collectives are the whole
    rank's, by name), recompute with a schedule that splits its backwards."""
    if turns is not None and paced is not None:
        raise ValueError(
            "turns pace simulated compute piece by piece between the waits; "
            "`paced` collectives are the pacer's: give one or the other"
        )
    if turns is not None and schedule.together:
        shared = [name for name, given in rank_wide.items() if given is not None]
        if shared:
            raise ValueError(
                f"turns: {schedule.name} runs its overlapped pairs in two "
                f"threads, which cannot share {', '.join(shared)} (the whole "
                "rank's collectives); run without turns"
            )
    if recompute and schedule.splits_backward:
        raise ValueError(
            f"recompute=True runs each stage's backward whole; {schedule.name} "
            "splits it into I and W, so it cannot recompute"
        )


def _check_stages(
    schedule: Schedule,
    stages: dict[int, nn.Module],
    tied: Sequence[dict[int, str]],
    rank: int,
    world_size: int,
) -> None:
    """Raises unless the schedule is for `world_size` ranks, `stages` are exactly the
    stages it puts on `rank`, and every tied weight named is in its stage's module."""
    if schedule.ranks != world_size:
        raise ValueError(f"the schedule is for {schedule.ranks} ranks, the group has {world_size}")
    mine = {s for s, r in enumerate(schedule.stage_rank) if r == rank}
    if set(stages) != mine:
        raise ValueError(
            f"rank {rank} holds stages {sorted(mine)} in this schedule, "
            f"got modules for {sorted(stages)}"
        )
    for names in tied:
        for s, name in names.items():
            if s in stages:
                stages[s].get_parameter(name)  # raises AttributeError naming it if absent


def _simulated_seconds(
    schedule: Schedule, compute: SimulatedCompute | None
) -> dict[str, list[float]] | None:
    """Each kind of action's simulated seconds on each stage (None: real compute only).
    Copies of a stage (DualPipe) cost what the stage costs."""
    if compute is None:
        return None
    per = compute.of(schedule.model_stages)
    return {k: [v[schedule.model_stage(t)] for t in range(schedule.stages)] for k, v in per.items()}


def _neighbours(schedule: Schedule) -> tuple[dict[int, int | None], dict[int, int | None]]:
    """Each stage's one stage before and one after on every route through it (a stage
    where microbatches enter has None before, one where they leave None after)."""
    before: dict[int, int | None] = {}
    after: dict[int, int | None] = {}
    for m in range(schedule.microbatches):
        for s in schedule.route(m):
            for table, other in (
                (before, schedule.previous_stage(s, m)),
                (after, schedule.next_stage(s, m)),
            ):
                if table.setdefault(s, other) != other:
                    raise ValueError(
                        f"stage {s} is reached from two stages ({table[s]} and "
                        f"{other}): the runtime needs one shape per stage"
                    )
    return before, after


def _depth(before: dict[int, int | None], stage: int) -> int:
    """How many stages come before `stage` on its route."""
    depth, previous = 0, before.get(stage)
    while previous is not None:
        previous = before.get(previous)
        depth += 1
    return depth
