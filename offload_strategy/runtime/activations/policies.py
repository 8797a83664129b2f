"""Per-block activation policies: keep a block's activations, or recompute them in backward.

The blocks are the repeated layers of a model: the outermost ``ModuleList`` / ``Sequential`` of
layers whose members train (a transformer's layers; :func:`block_lists`), or the modules of a
class the user names.
A checkpointed block runs under non-reentrant ``torch.utils.checkpoint``: it saves its inputs only
and recomputes the rest in backward, with the RNG state of the first run (dropout matches) and
the values its buffers had when the first run began (``runtime/activations/buffer_replay.py``; what the recomputation
writes to them is dropped). The engine keeps a unit a recomputation fetched resident until the
block's backward in that graph has unpacked the last view of its buffer (``runtime/params/recompute.py``).

A swap block (``swap_host``, ``swap_nvme``) runs its forward under the saved-tensor hooks of an
:class:`~offload_strategy.runtime.activations.swap.ActivationSwap`, which the strategy attaches once
it knows the device and the NVMe store; the interleaved layout of ProTrain §3.1.2 (swap blocks
first, checkpointed ones next, kept ones last) comes from ``planning/activations.py``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from ...config import ACTIVATION_PLANNERS, BLOCK_POLICIES, ActivationPlanner, BlockPolicy
from ...planning.activations import RECOMPUTED, BlockCost
from ...planning.profile import hold_spikes
from .swap import SWAP_HOST, SWAP_NVME, ActivationSwap
from .buffer_replay import BufferReplay
from .kv_cache import CacheReplay, caches_in
from .saved_tensors import SavedTensors
from ..params.forwards import UnitHook
from ..params.recompute import RecomputeHolds
from .saved_bytes import SavedBytes

KEEP, CHECKPOINT, CHECKPOINT_HOST = BlockPolicy.KEEP, BlockPolicy.CHECKPOINT, BlockPolicy.CHECKPOINT_HOST
POLICIES = BLOCK_POLICIES  # (KEEP, CHECKPOINT, CHECKPOINT_HOST, SWAP_HOST, SWAP_NVME)


def find_blocks(model: nn.Module, block_class: Optional[str] = None) -> list[nn.Module]:
    """The model's repeated blocks, in order; [] when it has none (see :func:`block_lists`)."""
    if block_class is not None:
        return [m for m in model.modules() if type(m).__name__ == block_class]
    lists = block_lists(model)
    return list(lists[0].members) if lists else []


@dataclass(frozen=True)
class BlockList:
    """A ``ModuleList`` / ``Sequential`` that may hold a model's blocks."""

    name: str  # its qualified name in the model
    members: tuple[nn.Module, ...]
    trainable: bool  # some member has a parameter that trains

    def rank(self) -> tuple[bool, bool, int]:
        """A list of several layers over one of a single (applied several times, ALBERT), one
        whose layers train over a frozen one (a teacher beside its student), then the longest."""
        return len(self.members) >= 2, self.trainable, len(self.members)


def block_lists(model: nn.Module) -> list[BlockList]:
    """The lists that may hold the model's blocks, best first: a ``ModuleList`` or ``Sequential``
    whose members all have parameters and are of one class, or a ``ModuleList`` of layers of
    several classes (a hybrid model's attention and Mamba layers), that is not inside a member of
    another such list of several (a decoder layer's per-head norms, a MoE layer's experts: the
    layers that hold them are the blocks, however many they are)."""
    found = [
        BlockList(name, tuple(module.children()), any(p.requires_grad for c in module.children() for p in c.parameters()))
        for name, module in model.named_modules() if _holds_layers(module)
    ]
    # (a list of one layer, ALBERT's, may hold a whole model: it hides nothing)
    inside = {id(m) for candidate in found if len(candidate.members) >= 2 for member in candidate.members for m in member.modules()}
    modules = dict(model.named_modules())
    outermost = [c for c in found if id(modules[c.name]) not in inside]
    return sorted(outermost, key=BlockList.rank, reverse=True)  # (stable: the first of equals first)


def _holds_layers(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(module.children())
    if not children or not all(any(True for _ in c.parameters()) for c in children):
        return False
    if len({_layer_class(c) for c in children}) == 1:
        return True
    # several classes: layers looped over (each a module of its own modules), not a pipeline of steps
    return isinstance(module, nn.ModuleList) and all(any(True for _ in c.children()) for c in children)


def _layer_class(module: nn.Module) -> type:
    """A module's class; a parametrized module's (weight norm's, spectral norm's) is a class of its
    own, made for it, whose base is the module's class."""
    return type(module).__bases__[0] if parametrize.is_parametrized(module) else type(module)


def describe_blocks(model: nn.Module, blocks: Sequence[nn.Module], calls: Sequence[int] = ()) -> str:
    """Which modules are the blocks, for the placement line: ``model.layers (24 × LlamaDecoderLayer)``."""
    if not blocks:
        return "no repeated blocks"
    names = {id(m): name for name, m in model.named_modules()}
    parents = list(dict.fromkeys(names.get(id(b), "?").rpartition(".")[0] or "(the model)" for b in blocks))
    classes: dict[str, int] = {}
    for block in blocks:
        classes[type(block).__name__] = classes.get(type(block).__name__, 0) + 1
    counted = ", ".join(f"{n} × {name}" for name, n in classes.items())
    where = parents[0] if len(parents) == 1 else f"{len(parents)} places ({', '.join(parents[:3])}{', ...' if len(parents) > 3 else ''})"
    said = f"{where} ({counted})"
    if any(n > 1 for n in calls):
        said += f", called {'/'.join(str(n) for n in dict.fromkeys(calls))} times per forward (each call under its block's policy)"
    return said


AUTO, TERAIO, LOHAN = ActivationPlanner.AUTO, ActivationPlanner.TERAIO, ActivationPlanner.LOHAN
PLANNERS = ACTIVATION_PLANNERS  # (AUTO, TERAIO, LOHAN)


def resolve_policies(blocks: Sequence[nn.Module], policy: Union[str, Sequence[str]]) -> list[str]:
    """One policy per block, from one name for all or a list with one per block."""
    per_block = [policy] * len(blocks) if isinstance(policy, str) else list(policy)
    if len(per_block) != len(blocks):
        raise ValueError(
            f"policy.activations lists {len(per_block)} block policies but the model has {len(blocks)} blocks; give one per block or one name for all."
        )
    unknown = sorted({p for p in per_block if p not in POLICIES})
    if unknown:
        raise ValueError(f"policy.activations={unknown} is not a block policy; choose from {', '.join(POLICIES)}, or 'auto' for all blocks.")
    return per_block


@dataclass
class BlockProfile:
    """What the profiling step saw of each block."""

    forward_seconds: list[float] = field(default_factory=list)
    input_bytes: list[int] = field(default_factory=list)
    activation_bytes: int = 0  # saved for backward by the measured block, kept (the blocks are alike)
    # the block that ran first in the profiled forward, kept and counted: a step may skip any
    # block (LayerDrop), the first among them
    measured: Optional[int] = None
    # what the forward's saved-tensor counter rose by from the start of the first block that ran
    # to the end of the last; None until a forward ran one, and again once the strategy took it
    blocks_saved_bytes: Optional[int] = None
    saved_before_blocks: int = 0  # ... and what it had counted when the first block started
    largest_through_blocks: int = 0  # the largest tensor it had saved when the last block ended
    reading_blocks: bool = False  # the profiled forward has started the blocks and has yet to end (``end_forward``)
    complete: bool = False  # a profiled forward that ran a block has ended: the blocks it skipped are taken as alike
    # a layout the user fixed, measured as it runs (``observe``): no block's policy changes, and
    # each block's first call counts what its forward saves whatever the policy does with it
    fixed: bool = False
    block_bytes: dict[int, int] = field(default_factory=dict)


class ActivationPolicies:
    """Applies block policies to a model, changes them, and takes them off again.

    With ``policy="auto"`` the first training step profiles: the first block that runs keeps its
    activations and counts them, the others are checkpointed (little memory whatever the batch),
    and every block's forward time and input size are recorded (a block the step skipped takes the
    others'); :meth:`block_costs` then feeds the planner, whose layout :meth:`apply` puts in place
    for the following steps.
    """

    def __init__(self, model: nn.Module, policy: Union[str, Sequence[str]], block_class: Optional[str] = None) -> None:
        self.blocks = find_blocks(model, block_class)
        self.named = functools.partial(describe_blocks, model, self.blocks)  # (called with the calls seen)
        if not self.blocks and (not isinstance(policy, str) or policy not in (KEEP, *PLANNERS)):
            where = f"of class {block_class!r}" if block_class else "(no ModuleList or Sequential of layers with parameters)"
            raise ValueError(f"policy.activations={policy!r} needs repeated blocks, but the model has none {where}; name them with policy.block_class.")
        self.auto = isinstance(policy, str) and policy in PLANNERS and bool(self.blocks)
        self.planner: Optional[str] = policy if self.auto and isinstance(policy, str) else None  # which search lays the blocks out
        self.swap: Optional[ActivationSwap] = None  # attached by the strategy when some block swaps
        self.recompute_holds: Optional[RecomputeHolds] = None  # the engine's, when there is one
        self.param_storages: set[int] = set()  # storages parameters live in this step: never swapped, never counted
        # the saved-tensor hooks that block hooks stand in for (the engine's), or None
        self.outer: Optional[tuple[Any, Any]] = None
        self.profile: Optional[BlockProfile] = None
        self._measured_saved: Optional[_MeasuredSaved] = None  # what the measured block's last forward saved
        # A block may be called several times in one forward (ALBERT applies one layer N times):
        # each call runs under the block's policy (a checkpoint per call, recomputed on its own),
        # and the block's costs are its calls' (``block_costs``). The most calls one training
        # forward made of each block, counted from ``begin_forward``:
        self.calls = [1] * len(self.blocks)
        self._calls_now = [0] * len(self.blocks)
        # (a hook whose copy does nothing: an EMA's deepcopy of the model copies no policies, nor the engine)
        self._call_hooks = [b.register_forward_pre_hook(UnitHook(functools.partial(self._count_call, i))) for i, b in enumerate(self.blocks)]
        self.block_flops: Optional[int] = None  # one forward of the first block, counted at the first training step
        self._wrapped: list[nn.Module] = []
        self._profile_hooks: list[Any] = []
        # called once the profiled forward's first block has run: every block's costs are known then
        self.after_first_block: Optional[Callable[[], None]] = None
        # called with the first block's arguments as it is called, before it runs; it may put
        # other policies in place, which that call follows (``apply`` after setting it)
        self.before_first_block: Optional[Callable[[tuple, dict], None]] = None
        # what the training forward has saved for backward so far (the strategy's counter): the
        # profile reads it at the blocks' ends, so what the forward keeps outside them is known
        self.saved_so_far: Callable[[], SavedBytes] = SavedBytes
        if self.auto:
            self.policies: list[str] = [KEEP, *[CHECKPOINT] * (len(self.blocks) - 1)]
            self.start_profile()
        else:
            self.policies = [KEEP] * len(self.blocks) if policy in PLANNERS else resolve_policies(self.blocks, policy)
        self.apply(self.policies)

    def _count_call(self, index: int, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and torch._C._current_autograd_node() is None:  # a training forward's, not a recomputation's
            self._calls_now[index] += 1
            self.calls[index] = max(self.calls[index], self._calls_now[index])

    def begin_forward(self) -> None:
        """A training forward starts: its blocks' calls are counted from none."""
        self._calls_now = [0] * len(self.blocks)

    @property
    def description(self) -> str:
        """Which modules are the blocks (and how often a forward calls them, where more than once)."""
        return self.named(self.calls)

    def apply(self, policies: Sequence[str]) -> None:
        """Put ``policies`` (one per block) in place of the current ones."""
        policies = resolve_policies(self.blocks, list(policies))
        self._unwrap()
        self.policies = policies
        for index, (block, choice) in enumerate(zip(self.blocks, self.policies)):
            if index == 0 and self.before_first_block is not None:
                # the policy is looked up as the block runs: the call that changes it follows it
                block.forward = WrappedForward(self._first_block, block.forward)
                self._wrapped.append(block)
            elif choice != KEEP or (self.profile is not None and (index == 0 or self.profile.fixed)):
                block.forward = WrappedForward(functools.partial(self._run_as, index, choice), block.forward)
                self._wrapped.append(block)
        if self.blocks and self.block_flops is None:
            first = self.blocks[0]
            first.forward = WrappedForward(self._flops_counted, first.forward)
            if first not in self._wrapped:
                self._wrapped.append(first)

    def _run_as(self, index: int, choice: str, forward: Any, *args: Any, **kwargs: Any) -> Any:
        if self._measures(index):
            return self._counted(forward, *args, **kwargs)
        if self._observes(index):
            forward = functools.partial(self._counted_under_policy, index, forward)
        if choice == CHECKPOINT:
            return _checkpointed(self, forward, *args, **kwargs)
        if choice == CHECKPOINT_HOST:
            return self._checkpointed_from_host(index, forward, *args, **kwargs)
        if choice in (SWAP_HOST, SWAP_NVME):
            return self._swapped(index, choice, forward, *args, **kwargs)
        return forward(*args, **kwargs)

    def _first_block(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.before_first_block is not None
        self.before_first_block(args, kwargs)  # may put other policies in place
        return self._run_as(0, self.policies[0], forward, *args, **kwargs)

    @property
    def recomputed_flops(self) -> int:
        """FLOPs a training step spends recomputing checkpointed blocks (each call counted as the first block's)."""
        return (self.block_flops or 0) * sum(n for p, n in zip(self.policies, self.calls) if p in RECOMPUTED)

    def _flops_counted(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        if self.block_flops is not None or not torch.is_grad_enabled() or torch._C._current_autograd_node() is not None:
            return forward(*args, **kwargs)
        counter = FlopCounterMode(display=False)
        with counter:
            out = forward(*args, **kwargs)
        self.block_flops = int(counter.get_total_flops())
        return out

    @property
    def swaps(self) -> set[str]:
        """The swap policies in use, ``swap_host`` for a block whose checkpoint's input waits in host memory."""
        return {SWAP_HOST if p == CHECKPOINT_HOST else p for p in self.policies if p in (SWAP_HOST, SWAP_NVME, CHECKPOINT_HOST)}

    def is_parameter(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.param_storages

    def _under_users_hooks(self) -> bool:
        """Saved-tensor hooks other than the ones block policies stand in for are on top: the
        user's own checkpoint or ``save_on_cpu`` around this block decides what it saves. Hooks
        pushed inside would take the block's tensors from them, and a non-reentrant checkpoint's
        recomputation, which runs without ours, would then save tensors its forward did not."""
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        hooks = top(False) if top is not None else None
        return hooks is not None and (self.outer is None or tuple(hooks) != tuple(self.outer))

    def _checkpointed_from_host(self, index: int, forward: Any, *args: Any, **kwargs: Any) -> Any:
        """A checkpoint whose input waits in host memory: the non-reentrant checkpoint saves the
        block's positional tensor inputs for its recomputation through the saved-tensor hooks
        around it (and only those: what the block saves inside is the checkpoint's), so under the
        swap's hooks they are copied out after forward and brought back ahead of the block's
        backward, the next such block's with them (DeepSpeed's ``cpu_checkpointing``; LoHan keeps
        its checkpoints' inputs in host memory too)."""
        if not torch.is_grad_enabled() or self.swap is None or self._under_users_hooks():
            return _checkpointed(self, forward, *args, **kwargs)
        with self.swap.hooks(index, SWAP_HOST):
            return _checkpointed(self, forward, *args, **kwargs)

    def _swapped(self, index: int, destination: str, forward: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or self.swap is None or self._under_users_hooks():
            return forward(*args, **kwargs)
        caches = caches_in(args, kwargs)
        with self.swap.hooks(index, destination), CacheReplay(caches).forward() if caches else contextlib.nullcontext():
            return forward(*args, **kwargs)

    # -- profiling (policy "auto"; a layout the user fixed, observed) --------------------------------

    def observe(self) -> None:
        """A layout the user fixed: the next training forward measures every block as the layout
        runs it (what each block's forward saves, its input, what the forward keeps beside the
        blocks), so that its peak is counted in the GPU tier as a planned layout's is; no block's
        policy changes. ``stop_observing`` when read."""
        if self.blocks and not self.auto:
            self.start_profile(fixed=True)
            self.apply(self.policies)  # every block wrapped while observed

    def stop_observing(self) -> None:
        if self.profile is not None and self.profile.fixed:
            self.end_profile()
            self.apply(self.policies)  # the kept blocks unwrapped again

    def start_profile(self, fastest: Optional[list[float]] = None, fixed: bool = False) -> None:
        """Time the blocks in the next training step (``fastest``: each block's least time so far,
        kept where this step's is longer; ``fixed``: the user's layout, observed)."""
        # the hooks below live as long as this profile (``end_profile`` removes both)
        profile = self.profile = BlockProfile(forward_seconds=[0.0] * len(self.blocks), input_bytes=[0] * len(self.blocks), fixed=fixed)
        kept = list(fastest) if fastest is not None else None
        started: dict[int, float] = {}
        done: set[int] = set()

        def pre(index: int, module: nn.Module, args: Any, kwargs: Any) -> None:
            if not torch.is_grad_enabled():
                return
            recompute = torch._C._current_autograd_node() is not None
            if (index in done) != recompute:
                return  # the first training forward, then its recomputation in backward
            if not recompute:
                profile.input_bytes[index] = sum(a.numel() * a.element_size() for a in (*args, *kwargs.values()) if torch.is_tensor(a))
            _synchronize(args)
            started[index] = time.perf_counter()

        def post(index: int, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if index not in started:
                return
            _synchronize(args)
            elapsed = time.perf_counter() - started.pop(index)
            # a recomputation runs warm: the lesser time is the block's own
            seconds = profile.forward_seconds
            seconds[index] = elapsed if index not in done else min(seconds[index], elapsed)
            if kept is not None and kept[index] > 0:
                seconds[index] = min(seconds[index], kept[index])
            first = index not in done
            done.add(index)
            if index == profile.measured and first and self.after_first_block is not None:
                self.after_first_block()

        for index, block in enumerate(self.blocks):
            self._profile_hooks.append(block.register_forward_pre_hook(functools.partial(pre, index), with_kwargs=True))
            self._profile_hooks.append(block.register_forward_hook(functools.partial(post, index), with_kwargs=True))
        self._done = done
        self._count_saved_in_blocks()

    def _count_saved_in_blocks(self) -> None:
        """What the forward's saved-tensor counter rises by from the start of the first block that
        runs to the end of the last one that runs, in the profiled forward (not a recomputation,
        not a later forward): every block is watched, as a step may skip any."""
        assert self.profile is not None
        profile = self.profile

        def start(module: nn.Module, args: Any) -> None:
            training = torch.is_grad_enabled() and torch._C._current_autograd_node() is None
            if training and not profile.reading_blocks and not profile.complete:
                profile.saved_before_blocks = self.saved_so_far().bytes
                profile.reading_blocks = True

        def end(module: nn.Module, args: Any, output: Any) -> None:
            # every call of a block in the profiled forward (the last block that runs, at its last
            # call, ends the blocks); prepended: the timing hook has yet to mark it done
            if profile.reading_blocks and torch.is_grad_enabled() and torch._C._current_autograd_node() is None:
                saved = self.saved_so_far()
                profile.blocks_saved_bytes = saved.bytes - profile.saved_before_blocks
                profile.largest_through_blocks = saved.largest

        for block in self.blocks:
            self._profile_hooks.append(block.register_forward_pre_hook(start))
            self._profile_hooks.append(block.register_forward_hook(end, prepend=True))

    def end_forward(self) -> None:
        """The profiled forward ended: a later one's calls of the blocks are not this one's, and
        where it ran a block the profile is complete (the blocks it skipped are taken as alike)."""
        self._measured_saved = None  # what was not swapped stays with autograd's graph alone
        if self.profile is not None:
            self.profile.reading_blocks = False
            self.profile.complete = self.profile.measured is not None

    @property
    def profiled(self) -> bool:
        return self.profile is not None and self.profile.complete

    def _measures(self, index: int) -> bool:
        """In the profiled forward the first block that runs keeps its activations and counts
        them, whatever its policy in the profiling layout (a step may skip the first block)."""
        profile = self.profile
        if profile is None or profile.fixed or not torch.is_grad_enabled() or torch._C._current_autograd_node() is not None:
            return False
        if profile.measured is None:
            profile.measured = index
        return profile.measured == index and index not in self._done

    def _observes(self, index: int) -> bool:
        """Under an observed layout the user fixed, a block's first call in the training forward."""
        profile = self.profile
        return (profile is not None and profile.fixed and index not in self._done and torch.is_grad_enabled()
                and torch._C._current_autograd_node() is None and not self._under_users_hooks())

    def _counted_under_policy(self, index: int, forward: Any, *args: Any, **kwargs: Any) -> Any:
        """The block's forward under the hooks its policy put on top (a checkpoint's, the swap's,
        or those the policies stand in for), each saved tensor counted on its way to them: what
        the block's backward materialises, whether the layout keeps, recomputes or swaps it."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        counted = SavedBytes()

        def pack(t: torch.Tensor) -> Any:
            packed = top[0](t) if top is not None else t
            # a streamed weight's 16-bit cast (autocast's) is saved as a reference to its unit and
            # cast again in backward: it holds nothing in the GPU tier until then
            if not self.is_parameter(t) and SavedTensors.unit_of(packed) is None:
                counted.add(t)
            return packed

        def unpack(packed: Any) -> torch.Tensor:
            return top[1](packed) if top is not None else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = forward(*args, **kwargs)
        profile = self.profile
        assert profile is not None and profile.fixed, "counted only while observed (``_observes``)"
        profile.block_bytes[index] = counted.bytes
        if profile.measured is None:
            profile.measured = index
        return out

    def _counted(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        """The measured block's forward, every tensor it saves counted and held where
        :meth:`move_measured_out` can swap it out once its cost is known."""
        if self._under_users_hooks():
            return forward(*args, **kwargs)  # (under the user's hooks the block keeps nothing of its own to count)
        outer, counted, held = self.outer, SavedBytes(), _MeasuredSaved()

        def pack(t: torch.Tensor) -> Any:
            packed = outer[0](t) if outer else t
            # as observed layouts count (``_counted_under_policy``): a streamed weight's 16-bit
            # cast, saved as a reference to its unit, holds nothing in the GPU tier until backward
            if not self.is_parameter(t) and SavedTensors.unit_of(packed) is None:
                counted.add(t)
            return held.hold(packed) if packed is t and not self.is_parameter(t) else packed

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, _Held):
                return held.unpack(packed)
            return outer[1](packed) if outer else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = forward(*args, **kwargs)
        assert self.profile is not None, "a block is counted only while profiled (``_measures``)"
        self.profile.activation_bytes += counted.bytes
        self._measured_saved = held
        return out

    def move_measured_out(self) -> None:
        """After the measured block's forward and the profiling layout's choice: where that layout
        swaps the measured block (``sequence.profiling_layout``: kept, it would not fit beside the
        blocks recomputed after it), what its forward saved is swapped out now, as a swap block's
        forward would have done, and brought back for its backward."""
        held, self._measured_saved = self._measured_saved, None
        measured = self.profile.measured if self.profile is not None else None
        if held is None or measured is None or self.swap is None or self.policies[measured] not in (SWAP_HOST, SWAP_NVME):
            return
        held.move_out(self.swap, measured, self.policies[measured])

    def first_block_costs(self) -> list[BlockCost]:
        """Every block's memory as the measured one (the first that ran) saw it, before the
        others have run (repeated blocks take inputs of one size and save what it did)."""
        assert self.profile is not None and self.profile.measured in self._done
        first = self.profile.input_bytes[self.profile.measured]
        one = BlockCost(activation_bytes=max(self.profile.activation_bytes, first), input_bytes=first, forward_seconds=0.0)
        return [_times(one, n) for n in self.calls]

    def block_costs(self) -> list[BlockCost]:
        """The profiled blocks as the planner sees them (every block saves what the measured one
        did; a block the profiled steps skipped takes its input and the median time of those that ran)."""
        assert self.profiled and self.profile is not None and self.profile.measured is not None
        measured, ran = self.profile.measured, sorted(self._done)
        seconds = list(self.profile.forward_seconds)
        others = sorted(seconds[i] for i in ran if i != measured)
        if others:  # the measured block ran once, cold; its recomputed likes ran warm
            seconds[measured] = min(seconds[measured], others[len(others) // 2])
        median = sorted(seconds[i] for i in ran)[len(ran) // 2]
        seconds = [s if i in self._done else median for i, s in enumerate(seconds)]
        inputs = [b if i in self._done else self.profile.input_bytes[measured] for i, b in enumerate(self.profile.input_bytes)]
        held = hold_spikes(dict(enumerate(seconds)), dict.fromkeys(range(len(seconds)), "block"))  # a stall of one block is not its work
        seconds = [held[i] for i in range(len(seconds))]
        return [
            _times(BlockCost(activation_bytes=max(self._activation_bytes(k), i), input_bytes=i, forward_seconds=f), n)
            for k, (i, f, n) in enumerate(zip(inputs, seconds, self.calls))
        ]

    def _activation_bytes(self, index: int) -> int:
        """What a block's call saves: the measured block's (the blocks are alike), or under an
        observed layout each block's own (the most of those counted for a block that did not run)."""
        assert self.profile is not None
        counted = self.profile.block_bytes
        if not self.profile.fixed or not counted:
            return self.profile.activation_bytes
        return counted.get(index, max(counted.values()))

    def per_call_input_bytes(self, costs: Sequence[BlockCost]) -> list[int]:
        """Each block's input for one of its calls, from its costs (which are its calls')."""
        return [c.input_bytes // n for c, n in zip(costs, self.calls)]

    def end_profile(self) -> None:
        for hook in self._profile_hooks:
            hook.remove()
        self._profile_hooks = []
        self.profile = None

    # -- taking it all off -------------------------------------------------------------------------

    def _unwrap(self) -> None:
        for block in self._wrapped:
            block.__dict__.pop("forward", None)  # back to the class's forward
        self._wrapped = []

    def remove(self) -> None:
        self._unwrap()
        self.end_profile()
        for hook in self._call_hooks:
            hook.remove()
        self._call_hooks = []


class _Held:
    """A tensor the measured block saved: as saved, or swapped out after its forward."""

    __slots__ = ("packed", "swapped")

    def __init__(self, packed: Any) -> None:
        self.packed, self.swapped = packed, False


class _MeasuredSaved:
    """The tensors the measured block's forward saved (parameters and what the outer hooks
    stand in for aside), which may be swapped out once the forward has ended."""

    def __init__(self) -> None:
        self.held: list[_Held] = []
        self.swap: Optional[ActivationSwap] = None

    def hold(self, t: torch.Tensor) -> _Held:
        held = _Held(t)
        self.held.append(held)
        return held

    def move_out(self, swap: ActivationSwap, block: int, destination: str) -> None:
        self.swap = swap
        for held, packed in zip(self.held, swap.pack_after_forward(block, destination, [h.packed for h in self.held])):
            held.packed, held.swapped = packed, True
        self.held = []  # the swap holds them now

    def unpack(self, held: _Held) -> torch.Tensor:
        if held.swapped:
            assert self.swap is not None, "swapped by move_out"
            return self.swap.unpack(held.packed)
        return held.packed


def _times(cost: BlockCost, calls: int) -> BlockCost:
    """A block called ``calls`` times in a forward: each call keeps (or, checkpointed, saves the
    input of, or recomputes) what one does, so the block's bytes and seconds are ``calls`` times
    one's. A recomputed block's peak is priced at all its calls' activations, though it
    recomputes one call at a time: more than it takes, never less."""
    if calls == 1:
        return cost
    return BlockCost(activation_bytes=cost.activation_bytes * calls, input_bytes=cost.input_bytes * calls,
                     forward_seconds=cost.forward_seconds * calls)


def _synchronize(args: Any) -> None:
    """Forward times on CUDA need the queued kernels finished."""
    for a in args:
        if torch.is_tensor(a) and a.is_cuda:
            torch.cuda.synchronize(a.device)
            return


class WrappedForward:
    """A block's forward run through a policy (``wrapper(forward, *args, **kwargs)``). A copy of
    the module (an EMA's ``deepcopy``, ``AveragedModel``) or a pickle of it gets the block's own
    forward: the policy belongs to this training run, not to the module."""

    def __init__(self, wrapper: Any, forward: Any) -> None:
        self.wrapper, self.forward = wrapper, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapper(self.forward, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        return copy.deepcopy(self.forward, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.forward.__reduce_ex__(protocol)


def _block_of(forward: Any) -> Any:
    """The module whose bound forward runs, through the partial an observed layout counts it in
    (``_counted_under_policy``): its buffers and key-value caches are replayed in recomputation."""
    while isinstance(forward, functools.partial):
        forward = forward.args[-1]
    return getattr(forward, "__self__", None)


def _checkpointed(policies: ActivationPolicies, forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)  # evaluation: nothing to save or recompute
    block = _block_of(forward)
    if not isinstance(block, nn.Module):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    tensors = _module_tensors(block)
    # the views of units' buffers this call saves, and the units each backward's recomputation holds
    views = policies.recompute_holds.track() if policies.recompute_holds is not None else None
    caches = caches_in(args, kwargs)
    # what the forward changes in place, given to each recomputation as the forward found it
    replays: list[Union[BufferReplay, CacheReplay]] = [BufferReplay(block), *([CacheReplay(caches)] if caches else [])]
    runs: list[None] = []

    def recompute_as_run(*args: Any, **kwargs: Any) -> Any:
        runs.append(None)  # the first run is the forward, every later one a recomputation
        first = len(runs) == 1
        with contextlib.ExitStack() as stack:
            stack.enter_context(_tensors_as(tensors))  # (first: the replays change the tensors it puts back)
            for replay in replays:
                stack.enter_context(replay.forward() if first else replay.recomputing())
            if views is not None:
                stack.enter_context(views.counting() if first else views.recomputing())
            return forward(*args, **kwargs)

    return checkpoint(recompute_as_run, *args, use_reentrant=False, **kwargs)


ModuleTensors = list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]


def _module_tensors(block: nn.Module) -> ModuleTensors:
    """The tensors a block's modules hold as parameters and buffers right now."""
    return [(m, dict(m._parameters), dict(m._buffers)) for m in block.modules()]


@contextlib.contextmanager
def _tensors_as(tensors: ModuleTensors) -> Any:
    """A checkpointed block recomputes in backward with the tensors its forward ran with.
    ``torch.func.functional_call`` (MAML's fast weights, ``torch.func``'s stateless calls) swaps
    other tensors into a module only for the call, so the recomputation, after it returned,
    would otherwise use the module's own parameters and give other gradients, silently."""
    now = _module_tensors(tensors[0][0]) if tensors else []
    same = len(now) == len(tensors) and all(
        m is n and _same_entries(ps, nps) and _same_entries(bs, nbs) for (m, ps, bs), (n, nps, nbs) in zip(tensors, now)
    )
    if same:
        yield
        return
    _put(tensors)
    try:
        yield
    finally:
        _put(now)


def _same_entries(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


def _put(tensors: ModuleTensors) -> None:
    for module, params, buffers in tensors:
        module._parameters.clear()
        module._parameters.update(params)
        module._buffers.clear()
        module._buffers.update(buffers)
