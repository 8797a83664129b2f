"""Data parallelism inside the engine: each unit's gradients reduced across ranks as backward
completes them, its update done by the rank that owns it, its new parameters sent to the others.

``DataParallel`` says who the ranks are and which rank owns which unit; ``GradientExchange`` is
mixed into :class:`~offload_strategy.runtime.engine.TieredEngine` and carries it out:

- A unit's gradients are reduced as soon as all of them are complete for the step (on the
  micro-batch that ends an accumulation, as DDP's ``no_sync`` does), asynchronously, while backward
  goes on; the unit's update waits for its reduction, so active gradient offloading (LoHan §IV-C)
  keeps running on each owner's CPU. Like DDP, each rank divides its gradient by the world size
  and the ranks sum: for two ranks, bit-identical to DDP's all-reduce.
- With sharded states the reduction goes to the unit's owner only (a reduce, the per-unit piece of
  ZeRO-2's reduce-scatter); the owner alone holds the unit's masters and optimizer states and
  updates it; after the step every owner broadcasts its updated units (the all-gather). When
  something needs every gradient on every rank first (clipping by norm, fp16 loss scaling), the
  reductions are all-reduces instead.
- Collectives are matched by their order on each process group, so every rank issues them in one
  canonical order (units by decreasing index, the order backward mostly completes them): a unit
  that completes early waits for the ones before it. A unit not complete by the optimizer step
  (a parameter unused on some rank) is reduced then, after the ranks agree on which parameters
  have a gradient anywhere; a rank without one contributes zeros, as DDP does for unused
  parameters. Gradient reductions, that agreement, and parameter broadcasts each use their own
  process group, so their sequences never interleave differently on different ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..planning.placement import GPU, HOST, HOST_SLOT_ALIGNMENT, NVME, align
from .state import UnitState


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

    def owns(self, unit_index: int) -> bool:
        return not self.shard_states or self.owners[unit_index] == self.rank

    def group_for(self, t: torch.Tensor) -> Any:
        return self.device_group if t.is_cuda else self.host_group


class GradientExchange:
    """Mixed into the engine: see the module docstring."""

    data_parallel: Optional[DataParallel]

    def _reset_reductions(self, mode: Optional[str]) -> None:
        """A backward starts. ``mode``: ``"owner"`` (reduce to each unit's owner), ``"all"`` (every
        rank gets every reduced gradient), or None (this micro-batch accumulates locally)."""
        self._reduce_mode = mode if self.data_parallel is not None else None
        self._reduction_order = [s for s in reversed(self.states) if s.unit.trainable]
        self._next_reduction = 0
        self._late_reductions_done = False
        for s in self.states:
            s.reduce_ready = False
            s.reductions = []

    def _unit_gradients_complete(self, s: UnitState) -> None:
        """Every gradient of ``s`` for this backward has arrived: reduce it (and then start its
        update) in the canonical order."""
        s.reduce_ready = True
        while self._next_reduction < len(self._reduction_order) and self._reduction_order[self._next_reduction].reduce_ready:
            ready = self._reduction_order[self._next_reduction]
            self._next_reduction += 1
            self._launch_reduction(ready, self._unit_gradients(ready))
            if self._update_in_backward and ready.home != GPU:
                self._submit_update(ready)

    def _unit_gradients(self, s: UnitState) -> list[torch.Tensor]:
        """The unit's gradients for this step, at the place where its update reads them."""
        if s.home == GPU:
            grads = [self._persistent_grads.get(id(p), p.grad) for p in s.unit.trainable]
            return [g for g in grads if g is not None]
        out = []
        for i, p in enumerate(s.unit.params):
            if p.requires_grad and s.grad_views[i] is not None and s.grad_fresh[i]:
                self._wait_grad(s, i)  # the copy from the GPU tier has landed
                out.append(s.grad_views[i])
        return out

    def _launch_reduction(self, s: UnitState, grads: list[torch.Tensor]) -> None:
        dp = self.data_parallel
        owner = dp.owners[s.unit.index]
        for g in grads:
            g.mul_(1.0 / dp.world_size)  # divided before the sum, as DDP's reducer does
            group = dp.group_for(g)
            if self._reduce_mode == "all" or not dp.shard_states:
                s.reductions.append(dist.all_reduce(g, group=group, async_op=True))
            else:
                s.reductions.append(dist.reduce(g, dst=owner, group=group, async_op=True))

    def _wait_reduction(self, s: UnitState) -> None:
        works, s.reductions = s.reductions, []
        for work in works:
            work.wait()

    def _reduce_late_units(self) -> None:
        """At the optimizer step: agree on which parameters have a gradient on some rank, then
        reduce the units backward did not complete here, in the canonical order."""
        if self._reduce_mode is None or self._late_reductions_done:
            return
        self._late_reductions_done = True
        dp = self.data_parallel
        params = [(s, i, p) for s in self._reduction_order for i, p in enumerate(s.unit.params) if p.requires_grad]
        local = torch.tensor([self._has_gradient(s, i, p) for s, i, p in params], dtype=torch.uint8)
        anywhere = local.clone()
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=dp.control_group)
        needed = {(id(s), i) for (s, i, _), here, there in zip(params, local.tolist(), anywhere.tolist()) if there and not here}
        for s in self._reduction_order[self._next_reduction :]:
            for i, p in enumerate(s.unit.params):
                if (id(s), i) in needed:
                    self._zero_gradient(s, i, p)
            self._launch_reduction(s, self._unit_gradients(s))
        self._next_reduction = len(self._reduction_order)

    def _has_gradient(self, s: UnitState, i: int, p: torch.Tensor) -> bool:
        if s.home == GPU:
            return id(p) in self._persistent_grads or p.grad is not None
        return s.grad_views[i] is not None and s.grad_fresh[i]

    def _zero_gradient(self, s: UnitState, i: int, p: torch.Tensor) -> None:
        """A parameter unused on this rank but used on another: it contributes zeros."""
        if s.home == GPU:
            if s.master_dtypes[i] != p.dtype:
                self._persistent_grads[id(p)] = torch.zeros(p.shape, dtype=s.master_dtypes[i], device=p.device)
            else:
                p.grad = torch.zeros_like(p)
        elif s.grad_views[i] is not None:
            self._wait_grad(s, i)
            s.grad_views[i].zero_()
            s.grad_fresh[i] = True

    def _share_updated_parameters(self) -> None:
        """After the step: each owner sends its updated units to the other ranks (ZeRO's all-gather
        of parameters, unit by unit); every rank's copy, wherever it lives, becomes the owner's."""
        dp = self.data_parallel
        if dp is None or not dp.shard_states:
            return
        works = []
        for s in self.states:
            if not s.unit.trainable:
                continue
            src = dp.owners[s.unit.index]
            if s.home == GPU:
                data = s.device_slot.tensor[: s.unit.nbytes]
                works.append(dist.broadcast(data, src=src, group=dp.group_for(data), async_op=True))
            elif s.home == HOST:
                data = self._home_bytes(s)
                works.append(dist.broadcast(data, src=src, group=dp.host_group, async_op=True))
            elif s.home == NVME:
                self._share_nvme_unit(s, src)
        for work in works:
            work.wait()

    def _share_nvme_unit(self, s: UnitState, src: int) -> None:
        """An NVMe unit goes through a staging buffer: read on the owner, written on the others."""
        dp = self.data_parallel
        if s.host_copy is not None:  # stale on the others, and the owner's was dropped at its update
            self.staging_pool.release(s.host_copy)
            s.host_copy = None
        staging = self._staging(s.unit.nbytes, wait=True)
        if staging is None:
            raise RuntimeError(f"no NVMe staging buffer is free to share unit {s.unit.name!r}; raise host_memory.")
        try:
            padded = staging.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)]
            if dp.rank == src:
                self.store.read(self._key(s), padded).result()
            dist.broadcast(padded[: s.unit.nbytes], src=src, group=dp.host_group)
            if dp.rank != src:
                self.store.write(self._key(s), padded).result()
        finally:
            self.staging_pool.release(staging)

    def _finish_reductions(self) -> None:
        for s in self.states:
            self._wait_reduction(s)
