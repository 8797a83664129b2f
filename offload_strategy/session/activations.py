"""The activation half of the planning session: block policies, swapping, and the layout the
planner chooses after the profiling step.

``ActivationControl`` is held by :class:`~offload_strategy.session.plans.PlanSession` and reads the
budgets, engine and policy from the context the strategy's core gives them (:class:`SessionContext`);
it owns the block policies, the swap machinery and the planned layout. Placing the parameters again
is the session's: when no layout fits beside them, ``choose_layout`` names the bytes they must fit in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

import torch

from ..config import BlockPolicy, HardwareSpec, PolicyConfig, format_bytes
from ..hardware.device import CopyStreams, Device, make_device
from ..hardware.probe import disk_free
from ..memory.nvme import NvmeStore
from ..planning.activations import ActivationPlan, BesideBlocks, BlockCost, Links, nvme_swapped_bytes
from ..planning.cost_model import machine_from_spec
from ..planning.placement import GPU
from ..runtime.activations.swap import SWAP_NVME, ActivationSwap
from ..runtime.activations.policies import ActivationPolicies
from ..runtime.activations.saved_bytes import SavedBytes
from . import sequence
from .sequence import Held

if TYPE_CHECKING:
    from ..planning.planner import Planner, TierBudgets
    from ..runtime.engine import TieredEngine


class SessionContext(Protocol):
    """What the session reads of the strategy's state (``lightning.context.TieredContext``): the
    options, the module, its optimizers and device, and what set-up made."""

    hardware: Optional[HardwareSpec]
    budgets: Optional["TierBudgets"]
    planner: Optional["Planner"]
    engine: Optional["TieredEngine"]
    copy_streams: Optional[CopyStreams]  # the run's copy streams, for a swap device of its own

    @property
    def policy(self) -> PolicyConfig: ...
    @property
    def nvme_path(self) -> Optional[Path]: ...
    @property
    def module(self) -> torch.nn.Module: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]: ...
    @property
    def max_batch_elements(self) -> Optional[int]: ...


def batch_elements(batch: Any) -> int:
    """The elements of every tensor in a batch (tensors, mappings and sequences of them, nested):
    what a batch's activations grow with when its tensors grow with batch size times sequence length."""
    if torch.is_tensor(batch):
        return batch.numel()
    if isinstance(batch, Mapping):
        return sum(batch_elements(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_elements(v) for v in batch)
    return 0


def _unchanged(t: Any) -> Any:
    return t


class ActivationControl:
    """See the module docstring."""

    def __init__(
        self, context: SessionContext, largest_on_every_rank: Callable[[int], int] = lambda n: n, say: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.context = context
        self.say = say  # a line for the user
        self._largest_on_every_rank = largest_on_every_rank  # under data parallelism, one batch size decides every rank's layout
        self.policies_in_use: Optional[ActivationPolicies] = None  # made at set-up
        self.swap_store: Optional[NvmeStore] = None
        self._swap_device: Optional[Device] = None
        self.plan: Optional[ActivationPlan] = None  # what activations="auto" chose
        self.searched: Optional[ActivationPlan] = None  # the layout the joint placement search chose with the parameters
        self.costs: list[BlockCost] = []  # ... from these block costs
        self.beside = BesideBlocks()  # ... beside these bytes (the activations outside the blocks, the backward's gradients)
        self.measured_beside = BesideBlocks()  # the most the profiled forwards kept outside the blocks, and their gradients
        self.plan_links: Optional[Links] = None  # ... and these links
        self._saved = SavedBytes()  # kept for backward by the last forward, without an engine
        self._counting = self._saved  # ... or the engine's count, as the saved-tensor hooks in use feed it
        self.planned_input_bytes = 0  # the first block's input the layout in place was planned for
        self.grown_costs: Optional[tuple[list[BlockCost], BesideBlocks]] = None  # a batch outgrew every layout beside the parameters as placed
        self._in_training_step = False
        self.profiled_elements: Optional[int] = None  # the smallest batch the profiled steps ran, under a max_batch
        self.fixed: Optional[ActivationPlan] = None  # a layout the user fixed, once its first training forward measured its peak
        self._fixed_counted = False  # ... counted, and not yet taken by the session (``take_fixed_peak``)

    @property
    def saved_bytes(self) -> int:
        """Kept for backward by the last training forward, without an engine."""
        return self._saved.bytes

    def start(self, module: torch.nn.Module, setting: Union[str, Sequence[str]]) -> None:
        self.policies_in_use = ActivationPolicies(module, setting, self.context.policy.block_class)
        self.policies_in_use.after_first_block = self.refuse_from_first_block
        if self.context.policy.name != "none":  # (policy 'none' keeps everything as plain training does, unplanned)
            self.policies_in_use.observe()  # a layout the user fixed: counted in the GPU tier once measured

    # -- what the core asks ---------------------------------------------------------------------------

    @property
    def blocks(self) -> list[torch.nn.Module]:
        return self.policies_in_use.blocks if self.policies_in_use is not None else []

    @property
    def described_blocks(self) -> str:
        """Which modules were taken as blocks, for the placement line."""
        return self.policies_in_use.description if self.policies_in_use is not None else "no repeated blocks"

    @property
    def policies(self) -> list[str]:
        return list(self.policies_in_use.policies) if self.policies_in_use is not None else []

    @property
    def auto(self) -> bool:
        return self.policies_in_use is not None and self.policies_in_use.auto

    @property
    def profiled(self) -> bool:
        """The profiled step measured the blocks and the layout has yet to be chosen."""
        activations = self.policies_in_use
        return self.measuring and activations is not None and activations.profiled

    @property
    def measuring(self) -> bool:
        """The blocks run the profiling layout: their own is chosen from what it measures."""
        activations = self.policies_in_use
        return activations is not None and activations.profile is not None and not activations.profile.fixed

    @property
    def observing(self) -> bool:
        """A layout the user fixed that no training forward has measured yet."""
        activations = self.policies_in_use
        return activations is not None and activations.profile is not None and activations.profile.fixed

    @property
    def observed(self) -> bool:
        """A layout the user fixed ran its first training forward, measured, and is not yet checked."""
        activations = self.policies_in_use
        return activations is not None and activations.profile is not None and activations.profile.fixed and activations.profiled

    @property
    def joint_search(self) -> bool:
        """The placement search chooses the layout too."""
        return self.profiled and self.policies_in_use is not None and self.policies_in_use.planner == "auto"

    def block_costs(self) -> list[BlockCost]:
        """The measured blocks' costs, for the longest batch where the user named one (``growth``)."""
        assert self.policies_in_use is not None
        return _scaled(self.policies_in_use.block_costs(), self.growth)

    # -- the longest batch ------------------------------------------------------------------------------

    @property
    def growth(self) -> float:
        """How much larger than the smallest profiled batch the ``max_batch`` the user named is (in
        tensor elements: activations grow with batch size times sequence length); 1 without one.
        Every layout from the profiled steps' refusals on is planned for it, so the plan holds for
        every batch up to it from the first step and none is laid out again mid-run."""
        bound, seen = self.context.max_batch_elements, self.profiled_elements
        return max(bound / seen, 1.0) if bound is not None and seen else 1.0

    def note_batch(self, batch: Any) -> None:
        """A training batch, before its forward: under a ``max_batch``, the smallest of the profiled
        steps' is what their measurements are scaled from; a batch larger than the bound is refused."""
        bound = self.context.max_batch_elements
        if bound is None or batch is None:
            return
        elements = batch_elements(batch)
        if elements > bound:
            raise ValueError(
                f"a training batch holds {elements:,} tensor elements, more than the {bound:,} of max_batch, the longest batch the "
                f"activation layout was planned for: give max_batch the longest batch the run will see (largest batch size and "
                f"sequence length), or leave it None to have larger batches laid out again as they come."
            )
        if self.policies_in_use is not None and self.policies_in_use.profile is not None and elements:
            self.profiled_elements = elements if self.profiled_elements is None else min(self.profiled_elements, elements)

    def gpu_parameter_bytes(self) -> int:
        """GPU tier taken by parameters, their gradients and optimizer states, as placed."""
        planner = self.context.planner
        placed = planner.gpu_placed if planner is not None else None
        if placed is not None:
            return placed
        return sum(p.numel() * p.element_size() for p in self.context.module.parameters())

    def held(self) -> Held:
        """What the placement in use holds, as the engine counts it (nothing without an engine)."""
        engine = self.context.engine
        if engine is None:
            return Held()
        store = engine.store.capacity if engine.store is not None else 0
        moved = sum(s.unit.nbytes for s in engine.states if s.home != GPU)
        return Held(engine.host_bytes_held(), max(engine.placement.nvme_bytes, store), engine.placement.spare_staging_bytes, moved)

    def host_left(self) -> int:
        budgets = self.context.budgets
        assert budgets is not None
        return self.held().host_left(budgets)

    def host_swap_bytes(self) -> int:
        """Host memory the activation layout in place swaps into."""
        if self.plan is None or not self.costs:  # a fixed layout: its swaps' bytes are not known, all of it may be theirs
            return self.host_left() if {BlockPolicy.SWAP_HOST, BlockPolicy.CHECKPOINT_HOST} & set(self.policies) else 0
        return sum(c.host_bytes(p) for c, p in zip(self.costs, self.plan.layout))

    def links(self, nvme_room: bool = True) -> Links:
        """The links swaps use beside the parameters' traffic as placed; with ``nvme_room``, the
        NVMe budget the placement leaves, which bounds the layout's swaps there (the joint search
        counts it per placement itself)."""
        context = self.context
        assert context.budgets is not None
        return self.held().links(machine_from_spec(context.hardware, nvme=context.nvme_path is not None), context.budgets, nvme_room)

    def nvme_room(self) -> int:
        """The NVMe budget the parameters' placement leaves (its units' parameters, states and spilled gradients)."""
        budgets = self.context.budgets
        assert budgets is not None
        return self.held().nvme_room(budgets)

    def swap_store_capacity(self) -> int:
        """What the activation swap's NVMe store may hold: the bytes the layout in place swaps
        there and, of its swap_host blocks' bytes, those beyond the host memory left (they go to
        NVMe), a quarter more for batches that grow before they are laid out again; within the
        room the NVMe budget leaves and what the disk has free now (the budget was read at
        set-up, and other processes may have filled the disk since). All that room where the
        layout's bytes are not known (a layout the user fixed)."""
        context = self.context
        room = min(self.nvme_room(), disk_free(str(context.nvme_path))) if context.nvme_path is not None else self.nvme_room()
        if self.plan is None or not self.costs:
            return max(room, 1)
        planned = nvme_swapped_bytes(self.costs, self.plan.layout) + max(self.host_swap_bytes() - self.host_left(), 0)
        return max(min(room, planned + planned // 4), 1)

    # -- the layout after the profiled step -----------------------------------------------------------

    def searched_with_placement(self, layout: Optional[ActivationPlan]) -> None:
        """The layout the joint placement search chose with the parameters (None: it chose none)."""
        self.searched = layout

    def choose_layout(self, costs: list[BlockCost], beside: BesideBlocks, lend_spare_staging: bool = False) -> Optional[int]:
        """The planner's layout for the measured ``costs``, ``beside`` the bytes outside the
        blocks' layouts (``sequence.choose_layout``); when none fits beside the parameters, the GPU
        bytes the parameters must be placed again in (then ``choose_layout_beside``).
        ``lend_spare_staging``: the placement in use is the profiling one, whose spare staging
        buffers the layout may have."""
        activations, planner = self.policies_in_use, self.context.planner
        assert activations is not None and planner is not None and activations.planner is not None
        self.costs, self.beside = costs, beside
        activations.end_profile()
        held = self.held()
        self.plan, parameter_bytes = sequence.choose_layout(
            planner, self.searched, costs, beside, self.links(), activations.planner, activations.policies, self.gpu_parameter_bytes(),
            self.host_left(), held.spare_staging if lend_spare_staging else 0,
        )
        return parameter_bytes

    def choose_layout_beside(self, costs: list[BlockCost]) -> None:
        """The layout for what the parameters, placed again, left (``sequence.layout_placed_again``)."""
        activations, planner = self.policies_in_use, self.context.planner
        assert activations is not None and planner is not None and activations.planner is not None and self.plan is not None
        self.plan = sequence.layout_placed_again(planner, self.plan, costs, self.beside, self.links(), activations.planner,
                                                 self.gpu_parameter_bytes(), self.host_left())

    def apply_layout(self) -> None:
        plan, activations = self.plan, self.policies_in_use
        assert plan is not None and activations is not None
        self.plan_links = self.links()
        self._watch_growth()
        activations.apply(plan.layout)
        self.attach_swap_if_needed()
        counts = {p: plan.layout.count(p) for p in sorted(set(plan.layout))}
        # the search's prediction covers the parameters' traffic too: one prediction per plan
        priced = "searched with the placement above" if plan is self.searched else f"predicted {plan.seconds * 1e3:.1f} ms per step"
        self.say(
            f"tiered: activation layout {' '.join(BlockPolicy(p).letter for p in plan.layout)} "
            f"({', '.join(f'{n} {p}' for p, n in counts.items())}), {priced};\n"  # a second line keeps both short
            f"  peak {format_bytes(plan.peak_bytes)} of activations in the GPU tier{self._beside_note()}."
        )

    def _beside_note(self) -> str:
        note = self.beside.note(" (of it, ")
        return f"{note})" if note else ""

    def refuse_from_first_block(self) -> None:
        """In the profiled step, as soon as the first block that runs has run forward (every
        block's memory is known from it): when no layout fits even beside the parameters' smallest share of the
        GPU tier, stop there, with the minimum, rather than after the whole step."""
        activations = self.policies_in_use
        if self.measuring and activations is not None and activations.profile is not None:
            measured = ("measured in the first block's forward of the first training step (what the forward keeps after the blocks, "
                        "the logits and the loss's among them, is not known yet and may ask for more)")
            # the counter has seen the first block's tensors and those before it
            beside = BesideBlocks(activations.profile.saved_before_blocks, 2 * self._counter().largest)
            costs = activations.first_block_costs()
            self._profile_from_host_if_needed(costs, beside)
            activations.move_measured_out()  # where the profiling layout swaps the block it measured kept
            self._refuse_if_unfitting(costs, measured, beside)

    def _profile_from_host_if_needed(self, costs: list[BlockCost], beside: BesideBlocks) -> None:
        """The profiling steps' layout (the first block kept, the others recomputed) with the
        recomputed blocks' inputs in host memory, then the measured block swapped there too, where
        in the GPU tier they would not fit beside the parameters' smallest share and out of it
        (host memory, then the NVMe tier) they would (``sequence.profiling_layout``). The blocks
        after the first have not run yet: they run so from this step on, as the planner may have
        them run; the measured block's saved tensors are swapped out as soon as it is chosen
        (``ActivationPolicies.move_measured_out``)."""
        activations, planner, budgets = self.policies_in_use, self.context.planner, self.context.budgets
        if activations is None or planner is None or budgets is None or not activations.auto or self.context.policy.name == "none":
            return
        running = activations.policies
        chosen = sequence.profiling_layout(planner, costs, beside, running, self.held().room(budgets, self.context.nvme_path is not None))
        if list(chosen) != running:
            activations.apply(chosen)
            self.attach_swap_if_needed()

    def refuse_unfitting(self) -> None:
        """Again once forward has measured every block and what it keeps outside them, before
        backward updates anything; a layout the user fixed is counted then."""
        activations = self.policies_in_use
        if self.profiled and activations is not None:
            self._refuse_if_unfitting(activations.block_costs(), "measured in the first training step before any update",
                                      self.measured_beside)  # scaled to max_batch there
        if self.observed:
            self._count_fixed_layout()

    def _count_fixed_layout(self) -> None:
        """A layout the user fixed, measured by the first training forward: its peak in the GPU
        tier, as a planned layout's (:func:`~offload_strategy.planning.activations.peak_bytes`
        beside what the forward keeps outside the blocks and the backward's gradients; scaled to
        ``max_batch``). Refused where it does not fit even beside the parameters' least share;
        else the session places the parameters again beside it before the next step
        (``take_fixed_peak``)."""
        activations, planner = self.policies_in_use, self.context.planner
        assert activations is not None and planner is not None
        growth = self.growth
        costs, beside = _scaled(activations.block_costs(), growth), self.measured_beside.scaled(growth)
        activations.stop_observing()
        measured = "measured in the first training step before any update" + (f", scaled {growth:.2f}x to max_batch" if growth > 1 else "")
        # one decision on every rank (each measured its own batch), before any refuses
        peak = self._largest_on_every_rank(planner.fixed_layout_peak(costs, activations.policies, beside))
        placed = self.gpu_parameter_bytes()
        planner.refuse_unfitting_fixed_layout(peak, activations.policies, measured, beside, placed)
        self._say_first_step_over(peak, placed)
        self.costs, self.beside = costs, beside
        self.fixed = ActivationPlan(tuple(activations.policies), 0.0, peak)
        self._fixed_counted = True

    def _say_first_step_over(self, peak: int, placed: int) -> None:
        """A fixed layout that fits beside the parameters' least share but not beside the one
        buffer more its measuring step runs them in: that step alone passes gpu_memory, said
        with the tier that holds it too."""
        budgets, planner, activations = self.context.budgets, self.context.planner, self.policies_in_use
        assert budgets is not None and planner is not None and activations is not None
        if placed + peak <= budgets.gpu:
            return
        self.say(
            f"tiered: the first training step, which measured the activation layout policy.activations fixes, holds "
            f"{format_bytes(placed + peak)} of gpu_memory={format_bytes(budgets.gpu)} at its peak ({format_bytes(peak)} of activations "
            f"beside {format_bytes(placed)} of parameters as placed for it); the steps after it place the parameters in what the layout "
            f"leaves. gpu_memory={format_bytes(planner.fixed_layout_minimum(peak, activations.policies), at_least=True)} holds the first "
            f"step too (the parameters' least share, one buffer more, and the layout)."
        )

    def take_fixed_peak(self) -> Optional[int]:
        """Once, after the first training forward measured a layout the user fixed: its peak."""
        counted, self._fixed_counted = self._fixed_counted, False
        return self.fixed.peak_bytes if counted and self.fixed is not None else None

    def _refuse_if_unfitting(self, costs: list[BlockCost], measured: str, beside: BesideBlocks) -> None:
        activations, planner = self.policies_in_use, self.context.planner
        if activations is None or not activations.auto or self.context.policy.name == "none" or planner is None:
            return
        assert activations.planner is not None
        growth = self.growth
        if growth > 1:
            measured += f", scaled {growth:.2f}x to max_batch"
            costs, beside = _scaled(costs, growth), beside.scaled(growth)
        # the profiled steps run their own layout (the first block kept) until the plan, beside the
        # parameters in their smallest share: it must fit too (without an engine every parameter
        # is in the GPU tier through those steps, whatever the planned layouts are placed beside)
        running = activations.policies if self.context.engine is not None else ()
        planner.refuse_unfitting_activations(costs, activations.planner, activations.policies, measured, beside, running=running)

    def note_forward_saved(self) -> None:
        """At the end of a profiled forward: what it kept for backward outside the blocks (the
        embeddings' output, the head's input, the logits' log-softmax), its total less what the
        counter rose by while the blocks ran, of it what was saved after the last block, and twice
        the largest tensor it saved (the backward's gradients) and had saved by the last block's
        end (the blocks' backward's). The layout is planned beside the most of each."""
        activations = self.policies_in_use
        profile = activations.profile if activations is not None else None
        if profile is None:
            return
        assert activations is not None
        activations.end_forward()  # a later forward's calls of the blocks are not this one's
        if profile.blocks_saved_bytes is None:
            return
        saved = self._counter()
        outside = max(saved.bytes - profile.blocks_saved_bytes, 0)
        after = max(outside - profile.saved_before_blocks, 0)
        profile.blocks_saved_bytes = None  # one reading per forward that ran the blocks
        measured = BesideBlocks(outside, 2 * saved.largest, after, 2 * profile.largest_through_blocks)
        self.measured_beside = self.measured_beside.largest(measured)

    def _counter(self) -> SavedBytes:
        """What the training forward has saved for backward so far, as the hooks in use count it:
        the engine's count, or this one's without an engine."""
        return self._counting

    def measure_blocks_again(self, keep_fastest: bool = False) -> None:
        """The blocks are timed again in the next training step (the first ran cold; with
        ``keep_fastest``, each block's least time over the steps timed so far is kept)."""
        activations = self.policies_in_use
        if self.measuring and activations is not None and activations.profile is not None:
            before = list(activations.profile.forward_seconds) if keep_fastest else None
            activations.end_profile()
            activations.start_profile(before)

    # -- the step ---------------------------------------------------------------------------------------

    def begin_block_forward(self) -> None:
        """Before a training forward: note the storages parameters live in this step (their
        tensors are never swapped or counted as activations)."""
        activations = self.policies_in_use
        if activations is None or not activations.blocks:
            return
        storages = {p.untyped_storage().data_ptr() for p in self.context.module.parameters()}
        engine = self.context.engine
        if engine is not None:
            memory = engine.memory
            storages |= {t.untyped_storage().data_ptr() for t in (memory.arena, memory.persistent_region, memory.slab.tensor, memory.home_region)}
        activations.param_storages.clear()
        activations.param_storages.update(storages)
        activations.begin_forward()
        self._in_training_step = True
        if activations.swap is not None:
            activations.swap.begin_forward()

    def end_training_step(self) -> None:
        self._in_training_step = False

    # -- batches larger than the layout was planned for --------------------------------------------------

    def _watch_growth(self) -> None:
        """Once a layout is in place, the first block's training forwards are watched: a batch
        whose blocks take larger inputs than the ones the layout was planned for (a longer
        sequence under dynamic padding, a larger batch than the profiled ones) is laid out again
        as the first block is called, before it runs (it runs under its new policy), rather than
        overflowing the GPU tier mid-run."""
        activations = self.policies_in_use
        if activations is None or not activations.blocks or not self.costs:
            return
        self.planned_input_bytes = max(activations.per_call_input_bytes(self.costs))  # the first block's call is what is watched
        activations.before_first_block = self._check_growth  # in place with the next ``apply``

    def _check_growth(self, args: Any, kwargs: Any) -> None:
        if not self._in_training_step or not torch.is_grad_enabled() or torch._C._current_autograd_node() is not None:
            return  # evaluation, or the recomputation of a checkpointed block in backward
        size = self._largest_on_every_rank(sum(a.numel() * a.element_size() for a in (*args, *kwargs.values()) if torch.is_tensor(a)))
        if self.planned_input_bytes > 0 and size > self.planned_input_bytes:
            self._lay_out_for(size)

    def _lay_out_for(self, input_bytes: int) -> None:
        """The layout for a batch whose first block takes ``input_bytes``: the measured blocks'
        costs scaled by the growth of their inputs (activations grow in proportion to batch size
        times sequence length), in what the parameters as placed leave of the GPU tier. When no
        layout fits there, this step runs the one with the least peak, and the parameters are
        placed again before the next
        (``grown_costs``); when none fits even there, the run stops with the minimum."""
        activations, planner = self.policies_in_use, self.context.planner
        assert activations is not None and planner is not None and activations.planner is not None
        growth = input_bytes / self.planned_input_bytes
        costs = _scaled(self.costs, growth)
        beside = self.beside.scaled(growth)
        links, host = self.links(), self.host_left()
        try:
            plan = planner.layout_beside(costs, links, activations.planner, self.gpu_parameter_bytes(), host, beside)
            then = ""
        except ValueError:
            measured = f"scaled from the measured blocks to a batch whose blocks' inputs are {growth:.2f}x theirs"
            planner.refuse_unfitting_activations(costs, activations.planner, activations.policies, measured, beside)
            # the least peak any layout reaches: this step overruns the GPU tier by as little as it can
            least = planner.least_activation_peak(costs, activations.planner, beside)
            plan = planner.layout_beside(costs, links, activations.planner, max(planner.gpu_beside(least), 0), host, beside)
            self.grown_costs = (costs, beside)
            then = (f"; no layout fits beside the parameters' {format_bytes(self.gpu_parameter_bytes())} of the GPU tier, so this "
                    f"step may exceed it, and the parameters are placed again before the next")
        self.costs, self.beside, self.plan, self.searched, self.planned_input_bytes = costs, beside, plan, None, input_bytes
        activations.apply(plan.layout)
        if activations.swaps and (activations.swap is None or self.swap_store is not None):
            self.attach_swap_if_needed()
            assert activations.swap is not None
            activations.swap.begin_forward()
        self.say(
            f"tiered: a batch whose blocks take {growth:.2f}x the inputs the activation layout was planned for: laid out again as "
            f"{' '.join(BlockPolicy(p).letter for p in plan.layout)}, peak {format_bytes(plan.peak_bytes)} of activations "
            f"in the GPU tier{self._beside_note()}{then}."
        )

    def take_grown_costs(self) -> Optional[tuple[list[BlockCost], BesideBlocks]]:
        """The blocks' costs and the bytes beside them of a batch that outgrew every layout
        beside the parameters as placed; None when there was none."""
        costs, self.grown_costs = self.grown_costs, None
        return costs

    @contextlib.contextmanager
    def counting_saved(self) -> Iterator[None]:
        """A forward without an engine: the bytes the blocks keep for backward are counted."""
        activations = self.policies_in_use
        if activations is None or not activations.blocks:
            yield
            return
        self._saved.clear()
        assert activations.outer is not None
        with torch.autograd.graph.saved_tensors_hooks(*activations.outer):
            yield

    def use_saved_tensor_hooks(self) -> None:
        """The hooks block policies stand in for: the engine's, or without one a counter of the
        bytes kept for backward."""
        activations, engine = self.policies_in_use, self.context.engine
        assert activations is not None
        outer = engine.forwards.saved_hooks() if engine is not None else (self._count_saved, _unchanged)
        activations.outer = outer
        self._counting = engine.saved_tensors.bytes if engine is not None else self._saved
        activations.saved_so_far = lambda: self._counting
        activations.recompute_holds = engine.recompute_holds if engine is not None else None
        if activations.swap is not None:
            activations.swap.outer = outer

    def _count_saved(self, t: torch.Tensor) -> torch.Tensor:
        assert self.policies_in_use is not None
        if not self.policies_in_use.is_parameter(t):
            self._saved.add(t)
        return t

    # -- swapping ---------------------------------------------------------------------------------------

    def attach_swap_if_needed(self) -> None:
        """The swap's hooks where the layout swaps; its NVMe store made again, between steps or
        before a step's first block, where the new layout swaps more there than it holds."""
        activations = self.policies_in_use
        if activations is None or not activations.swaps:
            return
        if activations.swap is not None and self.swap_store is not None and self.swap_store.capacity < self.swap_store_capacity():
            self._detach_swap()
        if activations.swap is None:
            self._attach_swap()

    def reattach_swap(self) -> None:
        """After the engine was replaced: the swap copied through the old engine's device, now closed."""
        if self.policies_in_use is not None and self.policies_in_use.swap is not None:
            self._detach_swap()
            self._attach_swap()

    def _attach_swap(self) -> None:
        """The saved-tensor hooks of swap blocks: the engine's device (or one of their own) and,
        for ``swap_nvme``, an NVMe store of their own beside the engine's."""
        context, activations = self.context, self.policies_in_use
        assert activations is not None and context.budgets is not None
        if SWAP_NVME in activations.swaps and context.nvme_path is None:
            raise ValueError(
                "policy.activations asks for swap_nvme but the strategy has no nvme_path; give nvme_path (a directory on "
                "a fast disk), or use swap_host."
            )
        engine = context.engine
        if engine is not None:
            device = engine.device
        else:
            device = make_device(context.root_device, capacity=0, spec=context.hardware, throttle=context.policy.throttle, streams=context.copy_streams)
            self._swap_device = device
        store = None
        if context.nvme_path is not None:  # swap_nvme blocks, and swap_host tensors beyond host memory
            store = NvmeStore(context.nvme_path, capacity=self.swap_store_capacity(), checksums=context.policy.checksums)
        self.swap_store = store
        host_limit = self.host_left()
        # the slab of swapped activations starts at what the layout swaps to host memory where known
        # (a layout the user fixed: the first step measures it)
        planned = min(self.host_swap_bytes(), host_limit) if self.plan is not None and self.costs else 0
        swap = ActivationSwap(device, store, activations.is_parameter, host_limit=host_limit, host_capacity=planned)
        swap.outer = activations.outer
        activations.swap = swap

    def _detach_swap(self) -> None:
        """Swapped activations dropped, the swap store and the swap's own device closed."""
        if self.policies_in_use is not None and self.policies_in_use.swap is not None:
            self.policies_in_use.swap.close()
            self.policies_in_use.swap = None
        if self.swap_store is not None:
            self.swap_store.close()
            self.swap_store = None
        if self._swap_device is not None:
            self._swap_device.close()
            self._swap_device = None

    def close(self) -> None:
        """Block policies off and the swap detached."""
        self._detach_swap()
        if self.policies_in_use is not None:
            self.policies_in_use.remove()
            self.policies_in_use = None

    # -- metrics ----------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        activations = self.policies_in_use
        if activations is not None and activations.blocks:
            for policy in BlockPolicy:
                out[f"activations/blocks_{policy}"] = sum(p == policy for p in activations.policies)
            out["activations/recomputed_flops"] = float(activations.recomputed_flops)
            if self.context.engine is None:
                out["activations/saved_bytes"] = float(self.saved_bytes)
        if self.plan is not None:
            out["activations/predicted_step_ms"] = 1e3 * self.plan.seconds
            out["activations/predicted_peak_bytes"] = float(self.plan.peak_bytes)
        swap = activations.swap if activations is not None else None
        if swap is not None:
            stats = swap.stats
            out["activations/swapped_host_bytes"] = float(stats.host_bytes)
            out["activations/swapped_nvme_bytes"] = float(stats.nvme_bytes)
            out["activations/swap_prefetched"] = int(stats.prefetched)
            out["activations/swap_waits"] = int(stats.waited)
            out["activations/swap_wait_ms"] = 1e3 * stats.wait_seconds
            out["activations/swap_host_full_bytes"] = float(stats.host_full_bytes)
        return out


def _scaled(costs: list[BlockCost], growth: float) -> list[BlockCost]:
    """Blocks' costs for a batch ``growth`` times as large (activations and inputs grow in
    proportion to batch size times sequence length, and so does the forward's time)."""
    if growth == 1:
        return costs
    return [replace(c, activation_bytes=round(c.activation_bytes * growth), input_bytes=round(c.input_bytes * growth),
                    forward_seconds=c.forward_seconds * growth) for c in costs]
