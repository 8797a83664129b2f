"""Per-block activation policies: keep a block's activations, or recompute them in backward.

The blocks are the repeated layers of a model: the longest ``ModuleList`` / ``Sequential`` whose
children are all of one class (a transformer's layers), or the modules of a class the user names.
A checkpointed block runs under non-reentrant ``torch.utils.checkpoint``: it saves its inputs only
and recomputes the rest in backward, with the RNG state of the first run (dropout matches). The
engine keeps a unit a recomputation fetched resident until the block's backward in that graph has
unpacked the last view of its buffer (``recompute.py``).

A swap block (``swap_host``, ``swap_nvme``) runs its forward under the saved-tensor hooks of an
:class:`~offload_strategy.runtime.activation_swap.ActivationSwap`, which the strategy attaches once
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
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from ..config import ACTIVATION_PLANNERS, BLOCK_POLICIES, ActivationPlanner, BlockPolicy
from ..planning.activations import RECOMPUTED, BlockCost
from ..profiling import hold_spikes
from .activation_swap import SWAP_HOST, SWAP_NVME, ActivationSwap
from .recompute import RecomputeHolds
from .kv_cache import CacheReplay, caches_in
from .saved_bytes import SavedBytes

KEEP, CHECKPOINT, CHECKPOINT_HOST = BlockPolicy.KEEP, BlockPolicy.CHECKPOINT, BlockPolicy.CHECKPOINT_HOST
POLICIES = BLOCK_POLICIES  # (KEEP, CHECKPOINT, CHECKPOINT_HOST, SWAP_HOST, SWAP_NVME)


def find_blocks(model: nn.Module, block_class: Optional[str] = None) -> list[nn.Module]:
    """The model's repeated blocks, in order; [] when it has none."""
    if block_class is not None:
        return [m for m in model.modules() if type(m).__name__ == block_class]
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1 and any(True for _ in children[0].parameters()):
                if len(children) > len(best):
                    best = children
    return best


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
    activation_bytes: int = 0  # saved for backward by the first block, kept (the blocks are alike)
    # what the forward's saved-tensor counter rose by from the first block's start to the last
    # block's end; None until a forward ran them all, and again once the strategy took it
    blocks_saved_bytes: Optional[int] = None
    saved_before_blocks: int = 0  # ... and what it had counted when the first block started
    largest_through_blocks: int = 0  # the largest tensor it had saved when the last block ended


class ActivationPolicies:
    """Applies block policies to a model, changes them, and takes them off again.

    With ``policy="auto"`` the first training step profiles: the first block keeps its
    activations and counts them, the others are checkpointed (little memory whatever the batch),
    and every block's forward time and input size are recorded; :meth:`block_costs` then feeds the
    planner, whose layout :meth:`apply` puts in place for the following steps.
    """

    def __init__(self, model: nn.Module, policy: Union[str, Sequence[str]], block_class: Optional[str] = None) -> None:
        self.blocks = find_blocks(model, block_class)
        if not self.blocks and (not isinstance(policy, str) or policy not in (KEEP, *PLANNERS)):
            where = f"of class {block_class!r}" if block_class else "(no ModuleList or Sequential of modules of one class)"
            raise ValueError(f"policy.activations={policy!r} needs repeated blocks, but the model has none {where}; name them with policy.block_class.")
        self.auto = isinstance(policy, str) and policy in PLANNERS and bool(self.blocks)
        self.planner: Optional[str] = policy if self.auto and isinstance(policy, str) else None  # which search lays the blocks out
        self.swap: Optional[ActivationSwap] = None  # attached by the strategy when some block swaps
        self.recompute_holds: Optional[RecomputeHolds] = None  # the engine's, when there is one
        self.param_storages: set[int] = set()  # storages parameters live in this step: never swapped, never counted
        # the saved-tensor hooks that block hooks stand in for (the engine's), or None
        self.outer: Optional[tuple[Any, Any]] = None
        self.profile: Optional[BlockProfile] = None
        self.block_flops: Optional[int] = None  # one forward of the first block, counted at the first training step
        self._wrapped: list[nn.Module] = []
        self._profile_hooks: list[Any] = []
        # called once the profiled first block has run forward: every block's costs are known then
        self.after_first_block: Optional[Callable[[], None]] = None
        # called with the first block's arguments as it is called, before it runs; it may put
        # other policies in place, which that call follows (``apply`` after setting it)
        self.before_first_block: Optional[Callable[[tuple, dict], None]] = None
        # what the training forward has saved for backward so far (the strategy's counter): the
        # profile reads it at the blocks' ends, so what the forward keeps outside them is known
        self.saved_so_far: Callable[[], SavedBytes] = SavedBytes
        if self.auto:
            self.policies = [KEEP] + [CHECKPOINT] * (len(self.blocks) - 1)
            self.start_profile()
        else:
            self.policies = [KEEP] * len(self.blocks) if policy in PLANNERS else resolve_policies(self.blocks, policy)
        self.apply(self.policies)

    def apply(self, policies: Sequence[str]) -> None:
        """Put ``policies`` (one per block) in place of the current ones."""
        policies = resolve_policies(self.blocks, list(policies))
        self._unwrap()
        self.policies = policies
        for index, (block, choice) in enumerate(zip(self.blocks, self.policies)):
            if index == 0 and self.before_first_block is not None:
                # the policy is looked up as the block runs: the call that changes it follows it
                block.forward = WrappedForward(self._first_block, block.forward)  # type: ignore[method-assign]
                self._wrapped.append(block)
            elif choice != KEEP or (self.profile is not None and index == 0):
                block.forward = WrappedForward(functools.partial(self._run_as, index, choice), block.forward)  # type: ignore[method-assign]
                self._wrapped.append(block)
        if self.blocks and self.block_flops is None:
            first = self.blocks[0]
            first.forward = WrappedForward(self._flops_counted, first.forward)  # type: ignore[method-assign]
            if first not in self._wrapped:
                self._wrapped.append(first)

    def _run_as(self, index: int, choice: str, forward: Any, *args: Any, **kwargs: Any) -> Any:
        if choice == CHECKPOINT:
            return _checkpointed(self, forward, *args, **kwargs)
        if choice == CHECKPOINT_HOST:
            return self._checkpointed_from_host(index, forward, *args, **kwargs)
        if choice in (SWAP_HOST, SWAP_NVME):
            return self._swapped(index, choice, forward, *args, **kwargs)
        if self.profile is not None and index == 0:
            return self._counted(forward, *args, **kwargs)
        return forward(*args, **kwargs)

    def _first_block(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.before_first_block is not None
        self.before_first_block(args, kwargs)  # may put other policies in place
        return self._run_as(0, self.policies[0], forward, *args, **kwargs)

    @property
    def recomputed_flops(self) -> int:
        """FLOPs a training step spends recomputing checkpointed blocks (each counted as the first)."""
        return (self.block_flops or 0) * sum(p in RECOMPUTED for p in self.policies)

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

    # -- profiling (policy "auto") ------------------------------------------------------------------

    def start_profile(self, fastest: Optional[list[float]] = None) -> None:
        """Time the blocks in the next training step (``fastest``: each block's least time so far,
        kept where this step's is longer)."""
        self.profile = BlockProfile(forward_seconds=[0.0] * len(self.blocks), input_bytes=[0] * len(self.blocks))
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
                self.profile.input_bytes[index] = sum(a.numel() * a.element_size() for a in (*args, *kwargs.values()) if torch.is_tensor(a))
            _synchronize(args)
            started[index] = time.perf_counter()

        def post(index: int, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if index not in started:
                return
            _synchronize(args)
            elapsed = time.perf_counter() - started.pop(index)
            # a recomputation runs warm: the lesser time is the block's own
            seconds = self.profile.forward_seconds
            seconds[index] = elapsed if index not in done else min(seconds[index], elapsed)
            if kept is not None and kept[index] > 0:
                seconds[index] = min(seconds[index], kept[index])
            first = index not in done
            done.add(index)
            if index == 0 and first and self.after_first_block is not None:
                self.after_first_block()

        for index, block in enumerate(self.blocks):
            self._profile_hooks.append(block.register_forward_pre_hook(functools.partial(pre, index), with_kwargs=True))
            self._profile_hooks.append(block.register_forward_hook(functools.partial(post, index), with_kwargs=True))
        self._done = done
        self._count_saved_in_blocks()

    def _count_saved_in_blocks(self) -> None:
        """What the forward's saved-tensor counter rises by from the first block's start to the
        last block's end, in the profiled forward (not a recomputation, not a later forward)."""
        assert self.profile is not None
        profile = self.profile

        def first_forward() -> bool:
            return torch.is_grad_enabled() and torch._C._current_autograd_node() is None and len(self._done) < len(self.blocks)

        def start(module: nn.Module, args: Any) -> None:
            if first_forward() and 0 not in self._done:
                profile.saved_before_blocks = self.saved_so_far().bytes

        def end(module: nn.Module, args: Any, output: Any) -> None:
            if first_forward():  # (prepended: the timing hook has yet to mark the last block done)
                saved = self.saved_so_far()
                profile.blocks_saved_bytes = saved.bytes - profile.saved_before_blocks
                profile.largest_through_blocks = saved.largest

        self._profile_hooks.append(self.blocks[0].register_forward_pre_hook(start))
        self._profile_hooks.append(self.blocks[-1].register_forward_hook(end, prepend=True))

    @property
    def profiled(self) -> bool:
        return self.profile is not None and len(self._done) == len(self.blocks)

    def _counted(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or self.profile is None or 0 in self._done or self._under_users_hooks():
            return forward(*args, **kwargs)  # (under the user's hooks the block keeps nothing of its own to count)
        outer, counted = self.outer, SavedBytes()

        def pack(t: torch.Tensor) -> Any:
            if not self.is_parameter(t):
                counted.add(t)
            return outer[0](t) if outer else t

        def unpack(packed: Any) -> torch.Tensor:
            return outer[1](packed) if outer else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = forward(*args, **kwargs)
        self.profile.activation_bytes += counted.bytes
        return out

    def first_block_costs(self) -> list[BlockCost]:
        """Every block's memory as the first one measured it, before the others have run
        (repeated blocks take inputs of one size and save what the first one did)."""
        assert self.profile is not None and 0 in self._done
        first = self.profile.input_bytes[0]
        return [BlockCost(activation_bytes=max(self.profile.activation_bytes, first), input_bytes=first, forward_seconds=0.0)] * len(self.blocks)

    def block_costs(self) -> list[BlockCost]:
        """The profiled blocks as the planner sees them (every block saves what the first one did)."""
        assert self.profiled
        seconds = list(self.profile.forward_seconds)
        if len(seconds) > 1:  # the first block ran once, cold; its recomputed likes ran warm
            others = sorted(seconds[1:])
            seconds[0] = min(seconds[0], others[len(others) // 2])
        held = hold_spikes(dict(enumerate(seconds)), dict.fromkeys(range(len(seconds)), "block"))  # a stall of one block is not its work
        seconds = [held[i] for i in range(len(seconds))]
        return [
            BlockCost(activation_bytes=max(self.profile.activation_bytes, i), input_bytes=i, forward_seconds=f)
            for i, f in zip(self.profile.input_bytes, seconds)
        ]

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


def _checkpointed(policies: ActivationPolicies, forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)  # evaluation: nothing to save or recompute
    block = getattr(forward, "__self__", None)
    if not isinstance(block, nn.Module):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    tensors = _module_tensors(block)
    # the views of units' buffers this call saves, and the units each backward's recomputation holds
    views = policies.recompute_holds.track() if policies.recompute_holds is not None else None
    caches = caches_in(args, kwargs)
    replay, runs = (CacheReplay(caches) if caches else None), []

    def recompute_as_run(*args: Any, **kwargs: Any) -> Any:
        runs.append(None)  # the first run is the forward, every later one a recomputation
        first = len(runs) == 1
        cached = contextlib.nullcontext() if replay is None else replay.forward() if first else replay.recomputing()
        held = contextlib.nullcontext() if views is None else views.counting() if first else views.recomputing()
        with cached, _tensors_as(tensors), held:
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
