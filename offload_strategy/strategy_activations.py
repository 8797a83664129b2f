"""The activation half of :class:`~offload_strategy.strategy.TieredStrategy`: block policies,
swapping, and the layout the planner chooses after the profiling step.

``ActivationControl`` is mixed into the strategy (as ``UnitUpdates`` is into the engine) and works
on the strategy's budgets, engine and policy; it owns the swap machinery and the planned layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info

from .config import BlockPolicy, format_bytes
from .hardware.device import Device, make_device
from .memory.nvme import NvmeStore
from .planning.activations import ActivationPlan, BlockCost, Links
from .planning.cost_model import machine_from_spec
from .planning.placement import GPU
from .runtime.activation_swap import SWAP_NVME, ActivationSwap
from .runtime.activations import ActivationPolicies

if TYPE_CHECKING:
    import lightning.pytorch as pl



def _unchanged(t: Any) -> Any:
    return t


class ActivationControl:
    """Mixed into the strategy: see the module docstring."""

    _activations: Optional[ActivationPolicies]
    _swap_store: Optional[NvmeStore]
    _swap_device: Optional[Device]
    activation_plan: Optional[ActivationPlan]
    activation_costs: list[BlockCost]
    activation_links: Optional[Links]
    _saved_bytes: int

    def _attach_swap(self) -> None:
        """The saved-tensor hooks of swap blocks: the engine's device (or one of their own) and,
        for ``swap_nvme``, an NVMe store of their own beside the engine's."""
        assert self._activations is not None and self.budgets is not None
        if SWAP_NVME in self._activations.swaps and self.nvme_path is None:
            raise ValueError(
                "policy.activations asks for swap_nvme but the strategy has no nvme_path; give nvme_path (a directory on "
                "a fast disk), or use swap_host."
            )
        if self.engine is not None:
            device = self.engine.device
        else:
            device = make_device(self.root_device, capacity=0, spec=self.hardware, throttle=self.policy.throttle)
            self._swap_device = device
        store = None
        if self.nvme_path is not None:  # swap_nvme blocks, and swap_host tensors beyond host memory
            used = self.engine.store.capacity if self.engine is not None and self.engine.store is not None else 0
            store = NvmeStore(self.nvme_path, capacity=max(self.budgets.nvme - used, 1), checksums=self.policy.checksums)
        self._swap_store = store
        swap = ActivationSwap(device, store, self._activations.is_parameter, host_limit=self._host_left())
        swap.outer = self._activations.outer
        self._activations.swap = swap

    def _begin_block_forward(self) -> None:
        """Before a training forward: note the storages parameters live in this step (their
        tensors are never swapped or counted as activations)."""
        activations = self._activations
        if activations is None or not activations.blocks:
            return
        storages = {p.untyped_storage().data_ptr() for p in self.lightning_module.parameters()}
        if self.engine is not None:
            storages |= {self.engine.arena.untyped_storage().data_ptr(), self.engine.slab.tensor.untyped_storage().data_ptr()}
        activations.param_storages.clear()
        activations.param_storages.update(storages)
        if activations.swap is not None:
            activations.swap.begin_forward()

    def _plan_activations(self, trainer: "pl.Trainer") -> None:
        """``activations="auto"``, after the profiling step: the planner chooses every block's
        policy and it is put in place. When no layout fits beside the parameters' share of the GPU
        tier, the parameters are placed again in the share the planner names (the optimizer states
        move through their standard state dicts, exactly) and the layout is chosen for what remains."""
        activations = self._activations
        assert activations is not None and self.planner is not None
        costs = self._same_on_every_rank(activations.block_costs())  # measured times differ between ranks
        self.activation_costs = costs
        activations.end_profile()
        planner = self.planner
        plan, parameter_bytes = planner.layout(
            costs, self._activation_links(), activations.planner, self._gpu_parameter_bytes(), self._host_left(), activations.policies,
        )
        if parameter_bytes is not None:
            self._replace_engine(trainer, gpu_bytes=parameter_bytes)
            plan = planner.layout_beside(costs, self._activation_links(), activations.planner, self._gpu_parameter_bytes(), self._host_left())
        self.activation_plan = plan
        self.activation_links = self._activation_links()
        activations.apply(plan.layout)
        if activations.swaps and activations.swap is None:
            self._attach_swap()
        counts = {p: plan.layout.count(p) for p in sorted(set(plan.layout))}
        rank_zero_info(
            f"tiered: activation layout {' '.join(BlockPolicy(p).letter for p in plan.layout)} "
            f"({', '.join(f'{n} {p}' for p, n in counts.items())}), predicted {plan.seconds * 1e3:.1f} ms per step, "
            f"peak {format_bytes(plan.peak_bytes)} of activations in the GPU tier."
        )

    def _refuse_activations_that_cannot_fit(self) -> None:
        """In the profiled step, once forward has measured the blocks and before backward updates
        anything: when no layout fits even beside the parameters' smallest share of the GPU tier,
        stop now, with the minimum, rather than after the first update."""
        activations = self._activations
        if activations is None or not activations.auto or activations.profile is None or not activations.profiled or self.policy.name == "none":
            return
        self.planner.refuse_unfitting_activations(activations.block_costs(), activations.planner, activations.policies)

    def _gpu_parameter_bytes(self) -> int:
        """GPU tier taken by parameters, their gradients and optimizer states, as placed."""
        placed = self.planner.gpu_placed if self.planner is not None else None
        if placed is not None:
            return placed
        return sum(p.numel() * p.element_size() for p in self.lightning_module.parameters())

    def _host_left(self) -> int:
        used = self.engine.slab.tensor.numel() + self.engine.master_region.numel() if self.engine is not None else 0
        return max(self.budgets.host - used, 0)

    def _use_saved_tensor_hooks(self) -> None:
        """The hooks block policies stand in for: the engine's, or without one a counter of the
        bytes kept for backward."""
        if self.engine is not None:
            outer = (self.engine.pack_saved, self.engine.unpack_saved)
        else:
            outer = (self._count_saved, _unchanged)
        self._activations.outer = outer
        if self._activations.swap is not None:
            self._activations.swap.outer = outer

    def _count_saved(self, t: torch.Tensor) -> torch.Tensor:
        if not self._activations.is_parameter(t):
            self._saved_bytes += t.numel() * t.element_size()
        return t

    def _activation_links(self) -> Links:
        machine = machine_from_spec(self.hardware, nvme=self.nvme_path is not None)
        moved = sum(s.unit.nbytes for s in self.engine.states if s.home != GPU) if self.engine is not None else 0
        return Links(
            d2h=machine.d2h, h2d=machine.h2d, nvme_write=machine.nvme_write, nvme_read=machine.nvme_read,
            parameter_forward_seconds=moved / machine.h2d, parameter_backward_seconds=moved / machine.h2d,
        )

    def _activation_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._activations is not None and self._activations.blocks:
            for policy in ("keep", "checkpoint", "swap_host", "swap_nvme"):
                out[f"activations/blocks_{policy}"] = float(self._activations.policies.count(policy))
            out["activations/recomputed_flops"] = float(self._activations.recomputed_flops)
            if self.engine is None:
                out["activations/saved_bytes"] = float(self._saved_bytes)
        if self.activation_plan is not None:
            out["activations/predicted_step_ms"] = 1e3 * self.activation_plan.seconds
            out["activations/predicted_peak_bytes"] = float(self.activation_plan.peak_bytes)
        swap = self._activations.swap if self._activations is not None else None
        if swap is not None:
            stats = swap.stats
            out["activations/swapped_host_bytes"] = float(stats.host_bytes)
            out["activations/swapped_nvme_bytes"] = float(stats.nvme_bytes)
            out["activations/swap_prefetched"] = float(stats.prefetched)
            out["activations/swap_waits"] = float(stats.waited)
            out["activations/swap_wait_ms"] = 1e3 * stats.wait_seconds
            out["activations/swap_host_full_bytes"] = float(stats.host_full_bytes)
        return out

    def _detach_swap(self) -> None:
        """Swapped activations dropped, the swap store and the swap's own device closed."""
        if self._activations is not None and self._activations.swap is not None:
            self._activations.swap.close()
            self._activations.swap = None
        if self._swap_store is not None:
            self._swap_store.close()
            self._swap_store = None
        if self._swap_device is not None:
            self._swap_device.close()
            self._swap_device = None

    def _close_activations(self) -> None:
        """Block policies off and the swap detached."""
        self._detach_swap()
        if self._activations is not None:
            self._activations.remove()
            self._activations = None
