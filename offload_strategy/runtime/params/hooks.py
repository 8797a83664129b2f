"""The hooks through which the model's modules reach the engine: a forward pre-hook on every module
that uses units (fetch them, pin them while it runs, time it), and a watch on its parameters read
as attributes (``module.weight`` used outside its module's forward, through the functional API, or
by another module), so that such a use is fetched like any other (docs/architecture.md,
invariants). Between steps a read lends the unit at home (``runtime/params/lending.py``). A parameter at an NVMe
placeholder read as a value arrives here too (:meth:`ModuleHooks.lend_parameter`, through
``runtime/params/offloaded.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...hardware import FreedHostMemory
from ...planning.placement import GPU
from .cache import UnitCache
from ..context import EngineContext, Phase
from .forwards import ForwardsBetweenSteps, UnitHook, outside_transforms
from .lending import Lending
from .recompute import RecomputeHolds
from ..activations.saved_tensors import SavedTensors
from ..state import UnitState
from ..timing import StepTimer
from ..units import TransferUnit


class _WatchedParameters(dict):
    """A module's ``_parameters``: reading a parameter as an attribute (``module.weight``) tells the
    engine, so a parameter used outside its module's forward — through the functional API, or by
    another module — is fetched like any other use (docs/architecture.md, invariants). Iteration
    (``parameters()``, ``state_dict()``) reads nothing and fetches nothing."""

    def __init__(self, original: dict, on_read: Any) -> None:
        super().__init__(original)
        self.on_read = on_read

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        if value is not None:
            self.on_read(value)
        return value

    def __reduce__(self) -> Any:
        # copies and pickles of the module (EMA, checkpoints) get a plain dict, not the engine
        return (dict, (dict(self),))


def _units_held_by(module: nn.Module, indices: list[int], states: list[UnitState]) -> set[int]:
    """Those of ``indices`` one of whose parameters ``module`` holds right now."""
    held = {id(p) for p in dict.values(module._parameters)}
    return {i for i in indices if any(id(p) in held for p in states[i].unit.params)}



class ModuleHooks:
    """See the module docstring."""

    def __init__(
        self, ctx: EngineContext, cache: UnitCache, lending: Lending, timer: StepTimer, recompute_holds: RecomputeHolds,
        saved: SavedTensors, forwards: ForwardsBetweenSteps, freed: FreedHostMemory,
    ) -> None:
        self.ctx, self.cache, self.lending, self.timer = ctx, cache, lending, timer
        self.freed = freed  # a module's temporaries are freed after its forward: given back past the limit
        self.recompute_holds, self.saved, self.forwards = recompute_holds, saved, forwards
        self.closed = False  # the engine closed: nothing is fetched or lent any more
        self._handles: list[RemovableHandle] = []
        self._watched: list[tuple[nn.Module, dict]] = []
        self._streamed: dict[int, UnitState] = {}  # id(param) -> its unit, for streamed units
        # units whose modules ran again in a backward (a checkpoint's recomputation, this runtime's
        # or the model's own), gathered until the strategy takes them (``take_recomputed``)
        self.recomputed_units: set[int] = set()

    def install(self, users: dict[nn.Module, list[TransferUnit]], modules: Iterable[nn.Module]) -> None:
        """Hook each module of ``users`` (every one, persistent ones too, so that the profiled step
        times them all), and ``modules`` (those holding a placed parameter) for the forwards
        between steps. Units computed on in place at home (MemFerry's DHA, ``placement.dha``) are
        never fetched."""
        states, in_place = self.ctx.states, self.ctx.placement.dha
        for module, used in users.items():
            indices = [u.index for u in used]
            fetched = [i for i in indices if states[i].home != GPU and i not in in_place]
            pre_hook, post_hook = self._make_hooks(indices, fetched)
            self._handles.append(module.register_forward_pre_hook(pre_hook))
            self._handles.append(module.register_forward_hook(post_hook, always_call=True))
        # the parameters an attribute read fetches: those of streamed units
        self._streamed = {id(p): s for s in states if s.home != GPU and s.unit.index not in in_place for p in s.unit.params}
        for module in users:
            self._watched.append((module, module._parameters))
            module._parameters = _WatchedParameters(module._parameters, self._on_read)
        self._handles.extend(self.forwards.install(modules))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, original in self._watched:
            current = module._parameters
            original.clear()
            original.update(current)  # keeps parameters registered or replaced meanwhile
            module._parameters = original
        self._watched = []

    def take_recomputed(self) -> set[int]:
        """The units recomputed in backward since the last call."""
        taken = set(self.recomputed_units)
        self.recomputed_units.clear()
        return taken

    def _make_hooks(self, indices: list[int], fetched: list[int]) -> tuple[UnitHook, UnitHook]:
        step, states, cache, timer, recomputed = self.ctx.step, self.ctx.states, self.cache, self.timer, self.recomputed_units

        def pre_hook(module: nn.Module, args: Any) -> None:
            self._refuse_stale_aliases(module)
            recomputing = torch._C._current_autograd_node() is not None
            if step.phase is Phase.BACKWARD and not recomputing:
                step.enter_forward()  # another forward in the same step (manual optimization)
            for i in fetched:
                cache.pin(i)
            if timer.timing is not None and step.phase is Phase.FORWARD and not recomputing:
                timer.module_starts(indices[0])
            # a torch.func transform differentiates: units whose parameters the module holds now
            # (functional_call may have swapped in others) stay for its backward
            held = _units_held_by(module, fetched, states) if not torch._C._autograd._saved_tensors_hooks_is_enabled() else ()  # type: ignore[attr-defined]
            for i in fetched:
                cache.request(i)
                if i in held:
                    cache.hold(i)
                if recomputing and torch.is_grad_enabled():  # a forward that backward recomputes
                    self.recompute_holds.fetched(states[i])
                    recomputed.add(i)

        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            for i in fetched:
                cache.unpin(i)
            self.freed.check()

        return UnitHook(pre_hook), UnitHook(post_hook)

    def _refuse_stale_aliases(self, module: nn.Module) -> None:
        """``torch.func.functional_call`` swapped tensors into ``module`` that are views of a
        streamed unit's GPU-tier copy (``p.detach()`` of parameters while their unit was there):
        other units' weights land in that buffer as the forward goes on, so computing with them
        would be wrong, silently."""
        for name, t in dict.items(module._parameters):
            if t is None or id(t) in self.ctx.param_slot or not isinstance(t, torch.Tensor):
                continue
            if self.saved.in_arena(t) and self.cache.owner(t.data_ptr()) is not None:
                raise RuntimeError(
                    f"{type(module).__name__}.{name} was given a view of a GPU-tier buffer (``p.detach()`` of a parameter strategy='tiered' "
                    f"streams, taken while its unit was in the GPU tier); other units' weights land in that buffer as the forward goes on. "
                    f"Give torch.func.functional_call the parameters themselves (``dict(model.named_parameters())``; gradients through "
                    f"torch.autograd.grad) or copies (``p.detach().clone()``)."
                )

    def _on_read(self, p: torch.Tensor) -> None:
        s = self._streamed.get(id(p))
        if s is None:
            return
        if torch._C._functorch.peek_interpreter_stack() is None:  # every attribute read of a streamed parameter: kept cheap
            self._read(s)
            return
        with outside_transforms():
            self._read(s)

    def _read(self, s: UnitState) -> None:
        if not self.ctx.step.active:
            self.lending.lend(s)
            return
        if s.resident and s.bound:
            return
        if torch.is_grad_enabled() and torch._C._current_autograd_node() is not None:
            # a checkpointed module's own forward recomputed in backward (its hooks ran in the
            # first forward only): held like every unit of a recomputed block
            self.cache.request(s.unit.index)
            self.recompute_holds.fetched(s)
            self.recomputed_units.add(s.unit.index)
            return
        self.cache.touch(s.unit.index)

    def lend_parameter(self, p: torch.Tensor, hands_out: bool) -> bool:
        """A parameter at a placeholder is read as a value: as if read as an attribute (between steps
        its unit is lent at home, inside a step fetched); False where that cannot be done.
        ``hands_out`` (``p.data``) inside a step: what the caller may write through it counts as
        written (a lent unit's writes are found by comparison when it is taken back)."""
        if self.closed or id(p) not in self.ctx.param_slot:
            return False
        self._on_read(p)
        if hands_out and self.ctx.step.active:
            s, i = self.ctx.param_slot[id(p)]
            self.cache.handed_out(s, i)
        return type(p) is nn.Parameter
