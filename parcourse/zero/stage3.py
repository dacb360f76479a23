"""ZeRO stage 3: the weights sharded too (Rajbhandari et al., arXiv:1910.02054).

Stage 2 (stage2.py) keeps every weight whole on every rank. Stage 3 keeps only this
rank's rows of them (the fp32 masters, and their 16-bit copy under mixed precision):

- one unit per module with parameters of its own, in forward order (a tied
  parameter goes with its first module);
- a module's units are all-gathered just before its forward and freed after;
  gathered again when the gradient of its output arrives in backward, and freed
  once their gradients are reduce-scattered;
- the next module's gather is started early (prefetch): the one after it in
  forward, the one before it in backward.

1.5x DDP's volume: an all-gather in forward, one in backward, a reduce-scatter.
ZeRO++ (zeropp.py) cuts what of it crosses nodes; ZeRO-Offload's parameter offload
(offload.py) keeps the shard of the weights on the host between uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parcourse import fp8
from parcourse.comm import Algorithm, Comm, Pending
from parcourse.comm.link import Network
from parcourse.memory import tensors_in
from parcourse.trace import Tracer
from parcourse.zero import zeropp
from parcourse.zero.layout import FlatUnit
from parcourse.zero.offload import OffloadTarget
from parcourse.zero.stage2 import ZeroStage2


class ZeroStage3(ZeroStage2):
    """`ZeroStage3(module, group=None, *, prefetch=True, offload_params=False,
    quantized_weights=False, fp8_all_gather=False, hpz_partition_size=None,
    quantized_gradients=False, ranks_per_node=None, ...)`, the arguments of `ZeroStage1` and these;
    `ZeroModel(module, stage=3)` builds one.

    - `prefetch`: start the next module's gather early.
    - `offload_params=True` (with `offload_optimizer="cpu"`): the shard of the weights
      lives on the host too, and comes over a unit at a time to be gathered.
    - ZeRO++ (zeropp.py): `quantized_weights` (qwZ: weights gathered as int8 with a scale
      a block), `hpz_partition_size=k` (hpZ: backward gathers from a copy sharded over
      the k ranks of a node), `quantized_gradients` (qgZ: the reduce-scatter as two
      quantized all-to-alls, inside then across nodes). `ranks_per_node` says where the
      nodes are (consecutive global ranks); it defaults to hpZ's k, or one node.
    - `fp8_all_gather=True` (torchtitan's float8 all-gather of FSDP's weights): the
      weights travel as e4m3, one byte an element, with one fp32 scale a parameter a
      rank (its shard's amax on e4m3's largest, 448), in the same message; the values are
      half of bf16's bytes to the byte, the scales 4 bytes a parameter. Forward and
      backward compute with the weights as FP8 holds them (at most 2**-4 of each from
      the master, `fp8.error_bound`); the masters and the gradients stay as they were.
    """

    stage = 3
    sharded_weights = True

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        prefetch: bool = True,
        bucket_mb: float = 25.0,
        compute_dtype: torch.dtype | None = None,
        algorithm: Algorithm = "auto",
        keep_modules: Iterable[nn.Module] = (),
        offload_optimizer: OffloadTarget = None,
        offload_params: bool = False,
        quantized_weights: bool = False,
        fp8_all_gather: bool = False,
        hpz_partition_size: int | None = None,
        quantized_gradients: bool = False,
        ranks_per_node: int | None = None,
        link: Network | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        if offload_params and offload_optimizer != "cpu":
            raise ValueError(
                "offload_params=True keeps the weights' shard beside the masters "
                "on the host: give offload_optimizer='cpu' too"
            )
        self.offload_params = bool(offload_params)
        super().__init__(
            module,
            group,
            bucket_mb=bucket_mb,
            compute_dtype=compute_dtype,
            algorithm=algorithm,
            keep_modules=keep_modules,
            offload_optimizer=offload_optimizer,
            link=link,
            tracer=tracer,
        )
        self.prefetch = prefetch
        if quantized_weights and fp8_all_gather:
            raise ValueError(
                "quantized_weights (int8) and fp8_all_gather are two ways of sending "
                "the weights: choose one"
            )
        self.quantized_weights = bool(quantized_weights)
        self.fp8_all_gather = bool(fp8_all_gather)
        self.quantized_gradients = bool(quantized_gradients)
        if ranks_per_node is not None and not (hpz_partition_size or quantized_gradients):
            raise ValueError(
                "ranks_per_node says where the nodes are for hpZ and qgZ; neither is on"
            )
        if hpz_partition_size == 1:  # a node of one rank: the copy would be whole, as
            hpz_partition_size = None  # in DeepSpeed, 1 means off
        self.hpz = hpz_partition_size
        if hpz_partition_size is not None:
            if hpz_partition_size < 1 or self.world_size % hpz_partition_size:
                raise ValueError(
                    f"hpz_partition_size ({hpz_partition_size}) must divide the "
                    f"group's {self.world_size} ranks"
                )
            if ranks_per_node is not None and ranks_per_node != hpz_partition_size:
                raise ValueError(
                    f"hpz_partition_size ({hpz_partition_size}) is the ranks of a "
                    f"node here; ranks_per_node says {ranks_per_node}"
                )
        per_node = ranks_per_node or hpz_partition_size or dist.get_world_size()
        self.nodes = (
            zeropp.Nodes.of(self.group, self.rank, self.world_size, per_node)
            if quantized_gradients or hpz_partition_size is not None
            else None
        )
        self.node_comm: Comm | None = None
        if hpz_partition_size is not None and hpz_partition_size < self.world_size:
            assert self.nodes is not None
            self.node_comm = Comm(
                zeropp.node_group(self.group, self.nodes),
                tracer=tracer,
                algorithm=algorithm,
                link=link,
            )

    def _group_params(
        self, module: nn.Module, params: list[nn.Parameter], bucket_mb: float
    ) -> list[list[nn.Parameter]]:
        """A unit per module with parameters of its own, in forward (registration) order;
        a tied parameter goes with its first module."""
        mine = {id(p) for p in params}
        seen: set[int] = set()
        groups = []
        for m in module.modules():
            new = [p for p in m.parameters(recurse=False) if id(p) in mine and id(p) not in seen]
            if new:
                groups.append(new)
                seen.update(id(p) for p in new)
        return groups

    def _in_backward_order(self, units: list[FlatUnit]) -> list[FlatUnit]:
        return units[::-1]  # units are in forward order

    def _install_gathers(self, module: nn.Module) -> None:
        """Free every unit now; each module gathers the units it needs before it runs."""
        for unit in self.units:
            unit.free()
        for m in module.modules():
            direct = [p for p in m.parameters(recurse=False) if id(p) in self._unit_of]
            if direct:
                indices = sorted({self._unit_of[id(p)].index for p in direct})
                needed = [self.units[i] for i in indices]
                m.register_forward_pre_hook(self._before_forward(needed))
                m.register_forward_hook(self._after_forward(needed))

    # -- gather before use, free after

    def _start_gather(self, unit: FlatUnit) -> None:
        if unit.gathered() or unit.gathering is not None:
            return
        started = time.perf_counter_ns()
        secondary = self._secondary_of(unit)
        if secondary is not None:  # hpZ: from the node's copy, inside it
            assert self.node_comm is not None
            whole = torch.empty(unit.padded, dtype=unit.full.dtype, device=unit.full.device)
            unit.gathering = (
                self.node_comm.all_gather(secondary, whole, async_op=True),
                started,
                "node",
            )
            unit.secondary = None  # backward's one use of it
        elif self.quantized_weights:  # qwZ: int8 and a scale a block
            part, _ = unit.gather_buffers()
            message = zeropp.encode(part)
            whole = torch.empty(
                self.world_size * message.numel(), dtype=torch.uint8, device=message.device
            )
            unit.gathering = (self.comm.all_gather(message, whole, async_op=True), started, "int8")
        elif self.fp8_all_gather:  # e4m3 and a scale a parameter
            part, _ = unit.gather_buffers()
            message = fp8_message(unit, part)
            whole = torch.empty(
                self.world_size * message.numel(), dtype=torch.uint8, device=message.device
            )
            unit.gathering = (self.comm.all_gather(message, whole, async_op=True), started, "fp8")
        else:
            unit.gathering = (
                self.comm.all_gather(*unit.gather_buffers(), async_op=True),
                started,
                "whole",
            )

    def _secondary_of(self, unit: FlatUnit) -> torch.Tensor | None:
        """hpZ's copy of the unit's weights, if it is of the weights as they are now."""
        if unit.secondary is None:
            return None
        if unit.secondary_version != unit.master._version:  # stepped since: stale
            unit.secondary = None
        return unit.secondary

    def _wait_gather(self, unit: FlatUnit, keep_secondary: bool = False) -> None:
        self._start_gather(unit)
        if unit.gathering is not None:
            future, started, kind = unit.gathering
            whole = future.result()
            unit.gathering = None
            if kind == "int8":
                n = whole.numel() // self.world_size
                whole = torch.stack(
                    [zeropp.decode(m, unit.part_numel)[0] for m in whole.view(self.world_size, n)]
                ).to(unit.full.dtype)
            elif kind == "fp8":
                whole = fp8_read(unit, whole.view(self.world_size, -1)).to(unit.full.dtype)
            unit.fill(whole)
            if keep_secondary and self.node_comm is not None and kind != "node":
                k = self.node_comm.size  # this rank's 1/k of the node's copy
                mine = whole.view(-1).chunk(k)[self.node_comm.rank]
                unit.secondary, unit.secondary_version = mine.clone(), unit.master._version
            self._comm_span("all_gather", started, unit)

    def _prefetch(self, index: int) -> None:
        if self.prefetch and 0 <= index < len(self.units):
            self._start_gather(self.units[index])

    def _before_forward(self, needed: list[FlatUnit]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            keep = torch.is_grad_enabled()  # hpZ: backward will gather inside the node
            for unit in needed:
                self._wait_gather(unit, keep_secondary=keep)
            self._prefetch(needed[-1].index + 1)

        return hook

    def _after_forward(self, needed: list[FlatUnit]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for unit in needed:
                unit.free()  # backward gathers again, when the gradient of the output arrives
            if torch.is_grad_enabled():
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(self._before_backward(needed))

        return hook

    def _before_backward(self, needed: list[FlatUnit]) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            for unit in needed:
                self._wait_gather(unit)
            self._prefetch(needed[0].index - 1)

        return hook

    # -- gradients: as stage 2, and the weights freed with them

    def _reduce_scatter(self, unit: FlatUnit, parts: torch.Tensor) -> Pending:
        if not self.quantized_gradients:
            return super()._reduce_scatter(unit, parts)
        assert self.nodes is not None
        nodes, comm, width = self.nodes, self.comm, unit.part_numel
        return comm.submit(lambda: zeropp.quantized_reduce_scatter(comm, parts, width, nodes))

    def _take_gradients(self, unit: FlatUnit) -> torch.Tensor:
        unit.free()  # backward is done with this unit's weights: free them before the
        return super()._take_gradients(unit)  # gradients' buffer is made (as FSDP2 does)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Stage 2's, and this rank's share of the weights: the fp32 master itself, or
        its 16-bit copy."""
        memory = super().memory_tensors()
        for u in self.units:
            assert u.compute_shard is not None  # stage 3's units keep one (sharded_weights)
            memory["params"].append(u.compute_shard)
        memory["params"] += [
            u.secondary
            for u in self.units  # hpZ's copies
            if u.secondary is not None
        ]
        return memory


# --------------------------------------------------------------------- FP8 all-gather


def _segments(unit: FlatUnit) -> list[tuple[int, int]]:
    """(start, end) of each parameter's chunk in a rank's part."""
    return [(o, o + n) for o, n in zip(unit.part_offsets, unit.chunk_numels)]


def fp8_message(unit: FlatUnit, part: torch.Tensor) -> torch.Tensor:
    """This rank's part as one uint8 message: [e4m3 values (part_numel) | fp32 scales,
    one a parameter], each parameter's chunk scaled by its own amax (`fp8.scale_for`)."""
    flat = part.reshape(-1).float()
    amax = torch.stack(
        [flat[a:b].abs().amax() if b > a else flat.new_zeros(()) for a, b in _segments(unit)]
    )
    scales = fp8.scale_for(amax, "e4m3")
    each = torch.ones_like(flat)
    for (a, b), scale in zip(_segments(unit), scales):
        each[a:b] = scale
    largest = torch.finfo(torch.float8_e4m3fn).max
    values = (flat * each).clamp_(-largest, largest).to(torch.float8_e4m3fn)
    return torch.cat([values.view(torch.uint8), scales.view(torch.uint8)])


def fp8_read(unit: FlatUnit, messages: torch.Tensor) -> torch.Tensor:
    """Every rank's part in fp32, (N, part_numel), from the N messages `fp8_message` made."""
    n = unit.part_numel
    values = messages[:, :n].contiguous().view(torch.float8_e4m3fn).float()
    scales = messages[:, n:].contiguous().view(torch.float32)  # (N, parameters)
    each = torch.ones_like(values)
    for i, (a, b) in enumerate(_segments(unit)):
        each[:, a:b] = scales[:, i : i + 1]
    return values / each


def fp8_gather_bytes(unit: FlatUnit) -> int:
    """Bytes one rank's FP8 all-gather message holds: a byte a value, 4 a parameter."""
    return unit.part_numel + 4 * len(unit.params)
