"""Data parallelism inside the engine: each unit's gradients reduced across ranks as backward
completes them, its update done by the rank that owns it, its new parameters sent to the others.

``DataParallel`` says who the ranks are and which rank owns which unit; ``GradientExchange``, held
by :class:`~offload_strategy.runtime.engine.TieredEngine`, carries it out:

- A unit's gradients are reduced as soon as all of them are complete for the step (on the
  micro-batch that ends an accumulation, as DDP's ``no_sync`` does), asynchronously, while backward
  goes on; the unit's update waits for its reduction, so active gradient offloading (LoHan §IV-C)
  keeps running on each owner's CPU. Like DDP, each rank divides its gradient by the world size
  and the ranks sum: for two ranks, bit-identical to DDP's all-reduce. A 16-bit parameter's
  gradient, accumulated in fp32 for its master, is reduced in its own dtype as DDP reduces it
  (half the bytes; an offloaded unit's in its landing area), and widened back where it is used.
- With sharded states the reduction goes to the unit's owner only (a reduce, the per-unit piece of
  ZeRO-2's reduce-scatter); the owner alone holds the unit's masters and optimizer states and
  updates it; after the step every owner broadcasts its updated units (the all-gather). Persistent
  units (GPU tier) are not sharded, as ProTrain's persistent chunks are not (§3.1.1): where the
  placement says ``replicated_persistent``, every rank all-reduces their gradients, keeps their
  states and updates them, and nothing is sent for them after the step. Where
  every backward reduces that way, the other ranks hold an offloaded unit's gradients only until
  they are sent: in a gradient buffer, not a home each (``runtime/grads/buffers.py``). Clipping by norm
  takes each gradient's norm on its owner and exchanges the norms (``norm_inputs``). When
  something else needs every gradient on every rank first (fp16 loss scaling, a hook that reads
  them), the reductions are all-reduces instead; so they are under manual optimization, whose
  code may backward again before its step (each rank's gradients then hold the earlier
  reductions, as DDP leaves them) and reads the gradients once its backward returns (the core
  waits for every reduction then: ``wait_all``). A new backward waits for the last one's
  reductions before its gradients add to the same tensors.
- Collectives are matched by their order on each process group, so every rank issues them in one
  canonical order (units by decreasing index, the order backward mostly completes them): a unit
  that completes early waits for the ones before it. A unit not complete by the optimizer step
  (a parameter unused on some rank) is reduced then, after the ranks agree on which parameters
  have a gradient anywhere; a rank without one contributes zeros, as DDP does for unused
  parameters. Gradient reductions, that agreement, and parameter broadcasts each use their own
  process group, so their sequences never interleave differently on different ranks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...planning.placement import GPU, HOST_SLOT_ALIGNMENT, NVME, align
from ..params.cache import UnitCache, slot_of
from .clipping import tensor_norms
from ..context import EngineContext
from .path import GradientPath
from ..updates.optimizers import LOOSE, UnitOptimizers
from ..state import UnitState
from ..updates.worker import Pending, UpdateWorker


@dataclass(frozen=True)
class DataParallel:
    """The ranks of a data-parallel run as one engine sees them."""

    rank: int
    world_size: int
    owners: tuple[int, ...]  # per unit index: the rank holding its masters and optimizer states
    host_group: Any  # gradients and parameters in host memory (gloo)
    device_group: Any  # ... in the GPU tier (the default group: NCCL on CUDA; the host group on CPU)
    control_group: Any  # which parameters have gradients anywhere, before late reductions
    shard_states: bool = True
    machines: int = 1  # the ranks span this many machines, as many on each
    # where each machine's ranks share host homes: this machine's ranks (the control group on one
    # machine), and this rank with the ranks of its local index on the other machines, as groups
    # and as global ranks in order (empty: every rank on one machine, none elsewhere)
    machine_group: Any = None
    peer_group: Any = None
    machine_ranks: tuple[int, ...] = ()
    peer_ranks: tuple[int, ...] = ()

    @property
    def ranks_per_machine(self) -> int:
        return len(self.machine_ranks) or self.world_size // self.machines

    @property
    def first_on_machine(self) -> bool:
        """This rank is its machine's first (the shared memory's maker, the first values' writer)."""
        return self.rank == (self.machine_ranks[0] if self.machine_ranks else 0)

    def is_peer(self, rank: int) -> bool:
        """Whether ``rank`` has this rank's local index on some machine (its peer group holds it)."""
        return rank in self.peer_ranks

    def owns(self, unit_index: int) -> bool:
        return not self.shard_states or self.owners[unit_index] == self.rank

    def group_for(self, t: torch.Tensor) -> Any:
        return self.device_group if t.is_cuda else self.host_group


def _all_reduce_seconds(group: Any, device: torch.device, elements: int, repeats: int) -> float:
    """The least time an all-reduce of ``elements`` fp32 numbers takes on ``group``, over
    ``repeats`` after one to warm up. Every rank of the group must call it."""
    tensor = torch.zeros(elements, dtype=torch.float32, device=device)
    best = float("inf")
    for attempt in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def collective_rate(group: Any, device: torch.device, nbytes: int = 8 << 20, repeats: int = 3) -> float:
    """Bytes/s each rank moves in an all-reduce of ``nbytes`` on ``group`` (a ring moves 2(N-1)/N
    of them per rank): what the step model prices reductions and parameter broadcasts at."""
    ranks = dist.get_world_size(group)
    return 2 * (ranks - 1) / ranks * nbytes / _all_reduce_seconds(group, device, nbytes // 4, repeats)


def collective_latency(group: Any, device: torch.device, repeats: int = 5) -> float:
    """Seconds an all-reduce of one number takes on ``group``: what every collective costs beyond its bytes."""
    return _all_reduce_seconds(group, device, 1, repeats)


class Reduction(enum.Enum):
    """How a backward's gradients are reduced across ranks."""

    OWNER = "owner"  # to each unit's owner (sharded states)
    ALL = "all"  # every rank gets every reduced gradient (something needs them all before the step)


class _Widening:
    """A reduction made in 16 bits whose sum, once waited for, is written into the fp32 gradient."""

    def __init__(self, work: Any, narrow: torch.Tensor, wide: torch.Tensor) -> None:
        self.work, self.narrow, self.wide = work, narrow, wide
        self.done = False

    def wait(self) -> None:
        self.work.wait()
        if not self.done:
            self.wide.copy_(self.narrow)
            self.done = True

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


class _Launch:
    """A unit's reductions as queued on the launcher: waited for, they have been launched (once
    its gradients had landed) and have ended."""

    def __init__(self) -> None:
        self.pending: Optional[Pending] = None
        self.works: list[Any] = []

    def wait(self) -> None:
        assert self.pending is not None, "queued before anything waits for it"
        self.pending.wait()
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return self.pending is not None and self.pending.done() and all(work.is_completed() for work in self.works)


class GradientExchange:
    """Reductions of each unit's gradients and broadcasts of updated units, in one canonical order
    on every rank (see the module docstring). Backward's reductions are launched from a thread of
    their own, in that order: it waits on the host for each unit's gradients to land (on a GPU a
    wait for everything queued before them) and divides them, autograd's thread only queues."""

    def __init__(self, ctx: EngineContext, data_parallel: DataParallel, gradients: GradientPath, cache: UnitCache) -> None:
        self.ctx, self.dp, self.gradients, self.cache = ctx, data_parallel, gradients, cache
        self.launcher = UpdateWorker(name="offload-reduce")
        self.reset(None)

    def reset(self, mode: Optional[Reduction]) -> None:
        """A backward starts. ``mode``: how its gradients are reduced; None: this micro-batch
        accumulates locally."""
        self.mode = mode
        self._order = [s for s in reversed(self.ctx.states) if s.unit.trainable]
        self._next = 0
        self._late_done = False
        for s in self.ctx.states:
            s.reduce_ready = False
            # a backward without an optimizer step since (manual accumulation): its reductions must
            # land before this one's gradients add to the same tensors
            s.wait_reductions()

    def wait_all(self) -> None:
        """Every reduction this backward started has landed (user code is about to read gradients)."""
        for s in self.ctx.states:
            s.wait_reductions()

    def complete(self, s: UnitState) -> list[UnitState]:
        """Every gradient of ``s`` for this backward has arrived: reduce it in the canonical order.
        Returns the units whose reductions started now (their updates may follow)."""
        s.reduce_ready = True
        started = []
        while self._next < len(self._order) and self._order[self._next].reduce_ready:
            ready = self._order[self._next]
            self._next += 1
            self._queue_launch(ready)
            started.append(ready)
        return started

    def _queue_launch(self, s: UnitState) -> None:
        """The unit's reductions, launched on the launcher once its gradients have landed, on the
        stream this thread computes on (where a GPU tier's gradients were made)."""
        launch, stream = _Launch(), self.ctx.device.compute_stream()

        def run() -> None:
            with stream:
                launch.works = self._launch(s, self.gradients.unit_gradients(s))

        launch.pending = self.launcher.submit(run)
        s.reductions.append(launch)
        self._mark_sent(s)

    def _mark_sent(self, s: UnitState) -> None:
        dp = self.dp
        if self._to_owner(s) and dp.owners[s.unit.index] != dp.rank and s.transient_gradients:
            self.gradients.buffers.sent(s)  # not needed here once sent: its buffer goes back then

    def _to_owner(self, s: UnitState) -> bool:
        return self.mode is Reduction.OWNER and self.dp.shard_states and not self.ctx.placement.replicated(s.unit.index)

    def _launch(self, s: UnitState, grads: list[tuple[torch.Tensor, Optional[torch.Tensor]]]) -> list[Any]:
        """The unit's reductions, launched; what to wait for."""
        dp = self.dp
        owner = dp.owners[s.unit.index]
        to_owner = self._to_owner(s)
        works: list[Any] = []
        for g, narrow in grads:
            g.mul_(1.0 / dp.world_size)  # divided before the sum, as DDP's reducer does
            reduced = g if narrow is None else narrow.copy_(g)
            group = dp.group_for(reduced)
            if to_owner:
                work = dist.reduce(reduced, dst=owner, group=group, async_op=True)
            else:
                work = dist.all_reduce(reduced, group=group, async_op=True)
            # the sum widens back for the fp32 master where it is used (not on a rank that only sent it)
            used_here = not to_owner or owner == dp.rank
            works.append(_Widening(work, narrow, g) if narrow is not None and used_here else work)
        return works

    def reduce_late_units(self) -> None:
        """At the optimizer step: agree on which parameters have a gradient on some rank, then
        reduce the units backward did not complete here, in the canonical order."""
        if self.mode is None or self._late_done:
            return
        self._late_done = True
        self.launcher.drain()  # backward's launched first, on every rank in the same order
        gradients = self.gradients
        params = [(s, i, p) for s in self._order for i, p in enumerate(s.unit.params) if p.requires_grad]
        local = torch.tensor([gradients.has_gradient(s, i, p) for s, i, p in params], dtype=torch.uint8)
        anywhere = local.clone()
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=self.dp.control_group)
        needed = {(id(s), i) for (s, i, _), here, there in zip(params, local.tolist(), anywhere.tolist()) if there and not here}
        for s in self._order[self._next :]:
            for i, p in enumerate(s.unit.params):
                if (id(s), i) in needed:
                    gradients.zero(s, i, p)
            s.reductions.extend(self._launch(s, gradients.unit_gradients(s)))
            self._mark_sent(s)
        self._next = len(self._order)

    def norm_inputs(self, unit_optimizers: UnitOptimizers) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """For clipping by norm once every reduction has ended: each gradient's norm in the
        facade's order, as a rank holding every reduced gradient takes it, and the gradients in
        memory here, to be multiplied. Under sharded states a rank holds the reduced gradients of
        its own units only: it takes their norms, and one all-reduce of a vector holding each norm
        once (the others' entries zero, so the sum is exact) gives every rank all of them, each in
        its gradient's dtype and device, so that the total is the same float on every rank and as
        ``clip_grad_norm_`` over every gradient takes it."""
        self.reduce_late_units()
        self.finish()
        if not self.dp.shard_states:
            return self.gradients.norm_inputs(unit_optimizers)
        order = unit_optimizers.order
        local: dict[int, torch.Tensor] = {}  # position in ``order`` -> the norm taken here
        in_memory: list[tuple[int, torch.Tensor]] = []
        others: dict[int, tuple[torch.dtype, torch.device]] = {}
        loose: set[int] = set()  # tensors every rank holds reduced (no unit's, or a replicated unit's): not exchanged
        for k, p in enumerate(order):
            found = unit_optimizers.slot_of.get(id(p))
            if found is None:
                if id(p) in self.ctx.param_slot and p.requires_grad:
                    others[k] = self.gradients.gradient_kind(p)
                continue
            if found[0].unit_index == LOOSE or self.ctx.placement.replicated(found[0].unit_index):
                loose.add(k)  # every rank holds it, reduced: its norm is taken here
            grad, norm = self.gradients.gradient_or_norm(found[0].unit_index, p)
            if grad is not None:
                in_memory.append((k, grad))
            elif norm is not None:
                local[k] = norm
        local.update(zip((k for k, _ in in_memory), tensor_norms([g for _, g in in_memory])))
        return self._exchange_norms(len(order), local, loose, others), [g for _, g in in_memory]

    def _exchange_norms(
        self, count: int, local: dict[int, torch.Tensor], loose: set[int], others: dict[int, tuple[torch.dtype, torch.device]],
    ) -> list[torch.Tensor]:
        """Every gradient's norm in order: this rank's own, and the other ranks' (float64 holds each
        exactly), in their gradients' dtypes and devices, where some rank has one."""
        values = torch.zeros(count, dtype=torch.float64)
        present = torch.zeros(count, dtype=torch.uint8)
        for k, norm in local.items():
            if k not in loose:
                values[k] = norm.detach().to("cpu", torch.float64)
                present[k] = 1
        dist.all_reduce(values, group=self.dp.control_group)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.dp.control_group)
        norms = []
        for k in range(count):
            if k in local:
                norms.append(local[k])
            elif k in others and present[k]:
                dtype, device = others[k]
                norms.append(values[k].to(dtype=dtype, device=device))
        return norms

    def share_updated_parameters(self) -> None:
        """After the step: each owner sends its updated units to the other ranks (ZeRO's all-gather
        of parameters, unit by unit); every rank's copy, wherever it lives, becomes the owner's."""
        dp = self.dp
        if not dp.shard_states:
            return
        works = []
        for s in self.ctx.states:
            if s.unit.trainable and not self.ctx.placement.replicated(s.unit.index):  # else every rank updated it
                work = self._send(s, dp.owners[s.unit.index])
                if work is not None:
                    works.append(work)
        for work in works:
            work.wait()
        self.homes_written()

    def _send(self, s: UnitState, src: int) -> Optional[Any]:
        """The owner ``src``'s updated unit to the ranks keeping a copy of it: every rank; where each
        machine's ranks share host homes, one rank of every other machine (the peers of ``src``'s
        local index write their machine's copy), or none on one machine."""
        dp = self.dp
        if s.home == GPU:
            data = slot_of(s).tensor[: s.unit.nbytes]
            return dist.broadcast(data, src=src, group=dp.group_for(data), async_op=True)
        if s.home == NVME:
            self._share_nvme_unit(s, src)
            return None
        if self.ctx.memory.shared_slab is None:
            return dist.broadcast(self.ctx.home_bytes(s), src=src, group=dp.host_group, async_op=True)
        if dp.is_peer(src):
            return dist.broadcast(self.ctx.home_bytes(s), src=src, group=dp.peer_group, async_op=True)
        return None

    def homes_written(self) -> None:
        """Where the machine's ranks share host homes: every rank waits until every owner has
        written its units there (their updates, or the first values), before any rank reads them."""
        if self.ctx.memory.shared_slab is not None:
            dist.barrier(group=self.dp.control_group)

    def _share_nvme_unit(self, s: UnitState, src: int) -> None:
        """An NVMe unit goes through a staging buffer: read on the owner, written on the others."""
        dp, ctx, store = self.dp, self.ctx, self.ctx.store
        assert store is not None, "NVMe units have the store"
        self.cache.drop_host_copy(s)  # stale on the others, and the owner's was dropped at its update
        staging = self.cache.staging(s.unit.nbytes, wait=True)
        if staging is None:
            raise RuntimeError(f"no NVMe staging buffer is free to share unit {s.unit.name!r}; raise host_memory.")
        try:
            padded = staging.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)]
            if dp.rank == src:
                store.read(ctx.key(s), padded).result()
            dist.broadcast(padded[: s.unit.nbytes], src=src, group=dp.host_group)
            if dp.rank != src:
                store.write(ctx.key(s), padded).result()
        finally:
            ctx.memory.staging_pool.release(staging)

    def finish(self) -> None:
        for s in self.ctx.states:
            s.wait_reductions()

    def close(self) -> None:
        self.launcher.close()
