"""The user's optimizer, applied unit by unit where each unit's master parameters live.

The optimizer returned by ``configure_optimizers`` stays the *facade*: its class, param groups
and hyperparameters are what the user set, LR schedulers keep changing its ``param_groups``, and
its ``state_dict()`` is in the standard torch format, interchangeable with plain training. Behind
it, every unit gets an optimizer of the same class over that unit's *master* parameters:

- a persistent unit's masters are its parameters, in the GPU tier;
- an offloaded unit's masters are separate tensors over its home (a host-slab slot, or for a unit
  at home on NVMe the staging buffer it is read into), with its gradients from the host gradient
  buffers. The model's parameters, whatever their residence, are never touched by an update.

Under ``*-true`` precisions a low-precision parameter's master is an fp32 tensor of its own: the
inner optimizer and its states work in fp32 and the low-precision copy is refreshed from the master
after each update. The facade's state dict carries each such master under the key ``"master"``, so
a checkpoint resumes exactly; a state dict without it (from plain training) starts the master
from the parameter.

So a unit can be updated on a CPU worker while backward continues with other units (LoHan §IV-C),
and any per-parameter optimizer works unchanged. Optimizers that need the whole model at once
(LBFGS: a closure that re-evaluates the loss) are refused.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import types
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from .chunks import step_in_chunks

# Optimizers whose step re-evaluates the model through a closure, which a unit cannot do alone.
WHOLE_MODEL_OPTIMIZERS = ("LBFGS",)
# The unit index of the inner optimizer over tensors no unit owns.
LOOSE = -1
# reads a unit's states from its file: (id of the master, state's key; None: the master itself) -> value
StatesReader = Callable[[], dict[tuple[int, Optional[str]], torch.Tensor]]


def check_per_parameter(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers that must re-evaluate the model inside their step: LBFGS, and any whose
    ``step`` requires a closure (SAM-style: perturb the weights, recompute the loss, step)."""
    name = type(optimizer).__name__
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if name in WHOLE_MODEL_OPTIMIZERS or (closure is not None and closure.default is inspect.Parameter.empty):
        raise ValueError(
            f"{name}.step requires a closure: it re-evaluates the whole model inside its step, so it cannot update offloaded "
            f"units one at a time; use a per-parameter optimizer (AdamW, Adam, SGD, ...), or raise gpu_memory so that nothing "
            f"is offloaded."
        )


# Tensors of the user's optimizer the coupling check steps, the smallest it holds.
COUPLING_PROBE_TENSORS = 3


def check_steps_each_parameter_alone(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose step couples parameters (reads several parameters or their
    states at once: a global norm, a shared statistic), which updating unit by unit would
    silently change. torch's own optimizers are per-parameter; any other class is checked by
    stepping copies of its smallest tensors together and one at a time, twice, with the same
    random gradients, and comparing the results bit for bit."""
    if type(optimizer).__module__.startswith("torch.optim"):
        return
    params = sorted(
        ((p, g) for g, group in enumerate(optimizer.param_groups) for p in group["params"]), key=lambda pg: pg[0].numel()
    )[:COUPLING_PROBE_TENSORS]
    if len(params) < 2:
        return
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype) for p, _ in params]
    grads = [[torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype) for p, _ in params] for _ in range(2)]

    def run(together: bool) -> list[torch.Tensor]:
        tensors = [v.clone() for v in values]
        hyper = {g: {k: v for k, v in optimizer.param_groups[g].items() if k != "params"} for _, g in params}
        # together: the user's groups; alone: one optimizer per tensor
        sets = [[(g, [t for t, (_, h) in zip(tensors, params) if h == g]) for g in hyper]] if together else [
            [(g, [t])] for t, (_, g) in zip(tensors, params)
        ]
        inners = [type(optimizer)([{**hyper[g], "params": ts} for g, ts in groups], **_constructor_defaults(optimizer)) for groups in sets]
        for step_grads in grads:
            for t, g in zip(tensors, step_grads):
                t.grad = g.clone()
            for inner in inners:
                inner.step()
        return tensors

    try:
        together = run(together=True)
    except Exception:
        return  # cannot be checked on stand-ins (it needs real shapes or devices): trusted, as documented
    try:
        alone = run(together=False)
        same = all(torch.equal(a, b) for a, b in zip(together, alone))
    except Exception:
        same = False
    if not same:
        shapes = ", ".join(str(tuple(p.shape)) for p, _ in params)
        raise ValueError(
            f"{type(optimizer).__name__} couples parameters in its step: stepping tensors of shapes {shapes} one at a time "
            f"gives other values than stepping them together. The tiered strategy updates each unit of offloaded parameters "
            f"on its own, so results would differ from plain training; use an optimizer whose update of a parameter reads only "
            f"that parameter, its gradient and its own state (AdamW, SGD, ...), or raise gpu_memory so that nothing is offloaded."
        )


# the stand-in parameter measured_state_factor steps
STATE_PROBE_SHAPE = (64, 64)


def measured_state_factor(optimizer: torch.optim.Optimizer) -> Optional[float]:
    """Bytes of optimizer state per parameter byte, measured: one step of the optimizer's class,
    with each param group's settings in turn, on an fp32 stand-in parameter; the most any group
    keeps (AdamW with ``amsgrad`` keeps three per-element states, RMSprop with ``centered`` and
    ``momentum`` three, plain SGD none). None where the class cannot be stepped on a stand-in."""
    most = 0.0
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        probe = torch.zeros(STATE_PROBE_SHAPE, dtype=torch.float32, requires_grad=True)
        try:
            inner = type(optimizer)([{**hyper, "params": [probe]}], **_constructor_defaults(optimizer))
            probe.grad = torch.ones_like(probe)
            inner.step()
        except Exception:
            return None
        # per-element states and factored ones (Adafactor's per row and column), not step counts
        held = sum(t.numel() * t.element_size() for t in inner.state[probe].values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        most = max(most, held / (probe.numel() * probe.element_size()))
    return most


@dataclass(eq=False)
class UnitSlot:
    """One unit's share of one facade: its parameters, masters and inner optimizer."""

    unit_index: int
    params: list[nn.Parameter]  # the model's parameters, in facade order
    masters: list[torch.Tensor]  # what the inner optimizer updates
    group_of: list[int]  # facade group index of each parameter
    inner: torch.optim.Optimizer
    inner_groups: list[int]  # facade group index of each inner group

    def widened(self, position: int) -> bool:
        """The parameter computes in low precision and is updated through an fp32 master."""
        return self.masters[position].dtype != self.params[position].dtype


class UnitOptimizers:
    """Inner optimizers of one facade, one per unit, and the facade's standard state dict.

    Membership follows the facade: parameters added to it (``add_param_group``, a finetuning
    callback) or unfrozen after set-up join their unit's inner optimizer at the next
    :meth:`missing` / :meth:`add`, so nothing the user's optimizer holds is left out. Tensors the
    model does not register (a free-standing scale the user passed with ``self.parameters()``)
    are updated where they are by the ``loose`` inner optimizer, as plain training would.
    """

    def __init__(
        self,
        facade: torch.optim.Optimizer,
        units: Sequence[tuple[int, list[nn.Parameter], list[torch.Tensor]]],
        managed: Optional[set[int]] = None,
        host_settings: Optional[dict[str, Any]] = None,
    ) -> None:
        """``units``: (unit index, its trainable parameters, their masters) for every unit;
        ``managed``: ids of every parameter the engine places (others in the facade are loose);
        ``host_settings``: hyperparameters that replace the facade's in the inner optimizers of
        units whose masters are in host memory (``host_implementation``)."""
        check_per_parameter(facade)
        check_steps_each_parameter_alone(facade)
        self.facade = facade
        self.host_settings = dict(host_settings or {})
        self.on_host: set[int] = set()  # unit indices whose inner optimizer takes host_settings
        self.step_kwargs: dict[str, Any] = {}  # the user's keyword arguments to this step (optimizer.step(**kwargs))
        self.managed = managed if managed is not None else {id(p) for _, params, _ in units for p in params}
        self.slots: dict[int, UnitSlot] = {}
        self.loose: Optional[UnitSlot] = None  # tensors the facade holds that no unit owns
        self.slot_of: dict[int, tuple[UnitSlot, int]] = {}  # id(param) -> (slot, position)
        # fp32 masters whose value is still the parameter's: taken from it right before their update
        self.stale: set[int] = set()
        self._refresh_order()
        for unit_index, params, masters in units:
            for p, m in zip(params, masters):
                if id(p) in self._group_of_param:
                    self.add(unit_index, p, m)
        self.adopt_loose()
        self._patch_facade()

    def _refresh_order(self) -> None:
        self._group_of_param = {id(p): g for g, group in enumerate(self.facade.param_groups) for p in group["params"]}
        self.order = [p for group in self.facade.param_groups for p in group["params"]]  # facade order = state-dict indices

    def all_slots(self) -> list[UnitSlot]:
        return [*self.slots.values(), *([self.loose] if self.loose is not None else [])]

    def add(self, unit_index: int, p: nn.Parameter, master: torch.Tensor) -> None:
        """``p`` (in the facade) joins unit ``unit_index``'s inner optimizer, updated through ``master``."""
        g = self._group_of_param[id(p)]
        slot = self.slots.get(unit_index) if unit_index != LOOSE else self.loose
        hyper = {k: v for k, v in self.facade.param_groups[g].items() if k != "params"}
        if slot is None and unit_index != LOOSE and master.device.type == "cpu" and self.host_settings:
            self.on_host.add(unit_index)
        settings = self.host_settings if unit_index in self.on_host else {}
        hyper.update(settings)
        if slot is None:
            inner = type(self.facade)([{**hyper, "params": [master]}], **{**_constructor_defaults(self.facade), **settings})
            slot = UnitSlot(unit_index, [], [], [], inner, [g])
            if unit_index == LOOSE:
                self.loose = slot
            else:
                self.slots[unit_index] = slot
        elif g in slot.inner_groups:
            slot.inner.param_groups[slot.inner_groups.index(g)]["params"].append(master)
        else:
            slot.inner.add_param_group({**hyper, "params": [master]})
            slot.inner_groups.append(g)
        slot.params.append(p)
        slot.masters.append(master)
        slot.group_of.append(g)
        self.slot_of[id(p)] = (slot, len(slot.params) - 1)

    def missing(self) -> list[nn.Parameter]:
        """Trainable parameters of the model the facade holds that no unit's inner optimizer has
        yet (added to the facade or unfrozen since): the engine adds each with its master."""
        self._refresh_order()
        return [p for p in self.order if id(p) in self.managed and id(p) not in self.slot_of and p.requires_grad]

    def adopt_loose(self) -> None:
        """Tensors in the facade that the model does not register: updated in place, as plain does."""
        self._refresh_order()
        for p in self.order:
            if id(p) not in self.managed and id(p) not in self.slot_of:
                self.add(LOOSE, p, p)

    # -- stepping -----------------------------------------------------------------------------------

    def sync_hyperparameters(self, slot: UnitSlot) -> None:
        """Copy what schedulers and users changed on the facade (lr, weight decay, ...) to the unit."""
        kept = self.host_settings if slot.unit_index in self.on_host else {}
        for inner_group, g in zip(slot.inner.param_groups, slot.inner_groups):
            for key, value in self.facade.param_groups[g].items():
                if key != "params" and key not in kept:
                    inner_group[key] = value

    def step(self, unit_index: int, chunk_bytes: int = 0) -> None:
        """The unit's inner step; ``chunk_bytes``: its larger parameters a chunk at a time
        (``step_in_chunks``: an update in host memory, its temporaries a chunk's)."""
        slot = self.slots[unit_index] if unit_index != LOOSE else self.loose
        if slot is None:
            return
        self.sync_hyperparameters(slot)
        if chunk_bytes:
            step_in_chunks(slot.inner, chunk_bytes, **self.step_kwargs)
        else:
            slot.inner.step(**self.step_kwargs)

    def count_step(self, closure_result: Any = None) -> None:
        """Run the facade's own step over no parameters, with the closure's result and the
        user's keyword arguments: its step hooks and the counters LR schedulers check see one
        step, and nothing is updated twice."""
        saved = [group["params"] for group in self.facade.param_groups]
        try:
            for group in self.facade.param_groups:
                group["params"] = []
            if "closure" in inspect.signature(self.facade.step).parameters:
                self.facade.step(closure=lambda: closure_result, **self.step_kwargs)
            else:
                self.facade.step(**self.step_kwargs)
        finally:
            for group, params in zip(self.facade.param_groups, saved):
                group["params"] = params

    # -- state dict in the facade's standard format --------------------------------------------------

    def adopt_replaced_state(self) -> None:
        """User code gave the facade a ``state`` mapping of its own (``optimizer.state =
        defaultdict(dict)``, which resets Adam's moments): the unit optimizers take what it holds,
        nothing for the parameters it lacks, and the facade shows their live states again."""
        replaced = self.facade.state
        if replaced is self.live:
            return
        self.facade.state = self.live  # type: ignore[assignment]
        for slot in self.all_slots():
            for p, master in zip(slot.params, slot.masters):
                if p in replaced:
                    self.live[p] = replaced[p]
                elif master in slot.inner.state:
                    del slot.inner.state[master]
                    self.states_replaced(slot.unit_index, master)

    def state_dict(self, materialize: Callable[[], contextlib.AbstractContextManager]) -> dict[str, Any]:
        self.adopt_replaced_state()
        with materialize():
            state: dict[int, dict[str, Any]] = {}
            for index, p in enumerate(self.order):
                found = self.slot_of.get(id(p))
                if found is None:
                    continue
                slot, position = found
                master = slot.masters[position]
                values = dict(slot.inner.state.get(master, {}))
                if slot.widened(position) and id(master) not in self.stale:
                    values["master"] = master.detach()  # its memory now: an NVMe unit's master is rebound after
                if values:
                    # the tensors themselves (no second copy of the states, as torch's own
                    # state_dict gives them), each over only its own bytes
                    state[index] = {k: compact(v) if torch.is_tensor(v) else v for k, v in values.items()}
        return {"state": state, "param_groups": self._packed_groups()}

    def _packed_groups(self) -> list[dict[str, Any]]:
        """The facade's param groups as torch packs them, without reading its states: those of
        NVMe units would each be read into memory."""
        states, self.facade.state = self.facade.state, collections.defaultdict(dict)
        try:
            return torch.optim.Optimizer.state_dict(self.facade)["param_groups"]
        finally:
            self.facade.state = states

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a standard state dict (from plain training or from us) into the inner optimizers."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.facade.param_groups):
            raise ValueError(f"the state dict has {len(groups)} param groups, the optimizer {len(self.facade.param_groups)}.")
        # hyperparameters (lr, initial_lr, ...) go to the facade, as torch does; its ``state`` stays
        # the live view (torch's load gives it a new mapping, which would read as a reset)
        torch.optim.Optimizer.load_state_dict(self.facade, {"state": {}, "param_groups": groups})
        self.facade.state = self.live  # type: ignore[assignment]
        saved = state_dict["state"]  # read per parameter: a sharded checkpoint's is read from disk on access
        saved_key = {int(k): k for k in saved}
        index_of = {id(p): i for i, p in enumerate(self.order)}
        for slot in self.all_slots():
            inner_state: dict[int, Any] = {}
            masters: dict[int, torch.Tensor] = {}
            for position, p in enumerate(slot.params):
                index = index_of[id(p)]
                if index in saved_key:
                    values = dict(saved[saved_key[index]])
                    master = values.pop("master", None)
                    if master is not None and slot.widened(position):
                        masters[position] = master
                    inner_state[self._inner_position(slot, position)] = values
            inner_groups = torch.optim.Optimizer.state_dict(slot.inner)["param_groups"]
            slot.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
            self.sync_hyperparameters(slot)
            for position, master in enumerate(slot.masters):
                if not slot.widened(position):
                    continue
                if position in masters:
                    self.set_master(master, masters[position].to(torch.float32))
                    self.stale.discard(id(master))
                else:
                    self.stale.add(id(master))
            self.after_slot_load(slot)

    @staticmethod
    def _inner_position(slot: UnitSlot, position: int) -> int:
        """Index of a master in the inner optimizer's own state-dict numbering."""
        master = slot.masters[position]
        flat = [m for group in slot.inner.param_groups for m in group["params"]]
        return next(i for i, m in enumerate(flat) if m is master)

    # -- the facade's methods ----------------------------------------------------------------------

    def _patch_facade(self) -> None:
        self._materialize: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        # what reading a unit's states needs first (the engine lends an NVMe unit's states)
        self.lend_states: Callable[[int], None] = lambda unit_index: None
        self.live = LiveState(self)
        self.facade.state = self.live  # type: ignore[assignment]
        units = self

        def state_dict(facade: torch.optim.Optimizer) -> dict[str, Any]:
            return units.state_dict(units._materialize)

        def load_state_dict(facade: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
            units.load_state_dict(state_dict)

        original_zero_grad = self.facade.zero_grad

        def zero_grad(facade: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            original_zero_grad(*args, **kwargs)
            units.on_zero_grad(units)

        # gradients of offloaded units live at home, not in ``.grad``: the engine forgets them
        self.on_zero_grad: Callable[[UnitOptimizers], None] = lambda units: None
        self.facade.zero_grad = types.MethodType(zero_grad, self.facade)  # type: ignore[method-assign]
        # each unit's loaded states, before the next unit's are read (the engine offloads NVMe units')
        self.after_slot_load: Callable[[UnitSlot], None] = lambda slot: None
        # user code removed or replaced a master's states (``optimizer.state.clear()``): where they
        # were kept apart (an NVMe unit's file), that place no longer holds them
        self.states_replaced: Callable[[int, torch.Tensor], None] = lambda unit_index, master: None
        # where a loaded fp32 master goes: into the master's memory (an NVMe unit's master has
        # none between updates, so the engine binds it to the value until it offloads it)
        self.set_master: Callable[[torch.Tensor, torch.Tensor], object] = lambda master, value: master.copy_(value)  # result unused
        self.facade.state_dict = types.MethodType(state_dict, self.facade)  # type: ignore[method-assign]
        self.facade.load_state_dict = types.MethodType(load_state_dict, self.facade)  # type: ignore[method-assign]

    def restore_facade(
        self, in_memory: Callable[[int], contextlib.AbstractContextManager],
        readers: Callable[[int], Optional[StatesReader]] = lambda unit: None,
    ) -> None:
        """End of training: the facade holds the real states of its own parameters, as after plain
        training. ``in_memory(unit)`` holds a unit's offloaded states in memory while they are
        taken (one unit at a time); a unit ``readers`` gives a function for stays on NVMe: its
        parameters' states are read from the file when first used (``StatesReadOnUse``)."""
        state = StatesReadOnUse()
        for index, slot in [*self.slots.items(), *([(LOOSE, self.loose)] if self.loose is not None else [])]:
            read = readers(index)
            if read is not None:
                state.defer([p for p, master in zip(slot.params, slot.masters) if slot.inner.state.get(master)], _unit_states(slot, read))
                continue
            with in_memory(index):
                for position, (p, master) in enumerate(zip(slot.params, slot.masters)):
                    values = slot.inner.state.get(master)
                    if values:
                        state[p] = _plain_states(slot, position, values, {})
        self._leave_facade(state)

    def hand_over(self, readers: Callable[[UnitSlot], Optional[StatesReader]], now: Callable[[int], bool]) -> dict[str, Any]:
        """Placing the units again: the facade's state dict for the next engine, in
        :meth:`state_dict`'s format (fp32 states and masters), whose entries the next engine's
        ``load_state_dict`` takes one at a time (``StatesToMove``). States in memory go as they
        are, no copy; those of a slot ``readers`` gives a function for are read from the unit's
        file with the rest of the unit when the first is taken (at once where ``now(unit)``: its
        file goes with this engine). The facade is left plain, its state empty, until then."""
        self.adopt_replaced_state()
        moving = StatesToMove()
        index_of = {id(p): i for i, p in enumerate(self.order)}
        for slot in self.all_slots():
            held = [
                (index_of[id(p)], id(master), values) for position, (p, master) in enumerate(zip(slot.params, slot.masters))
                if id(p) in index_of and (values := self._moving_values(slot, position))
            ]
            read = readers(slot)
            if read is None:
                for index, _, values in held:
                    moving.add(index, values)
            else:
                moving.defer([index for index, _, _ in held], _read_into(held, read), now(slot.unit_index))
        groups = self._packed_groups()
        self._leave_facade(collections.defaultdict(dict))
        return {"state": moving, "param_groups": groups}

    def _moving_values(self, slot: UnitSlot, position: int) -> dict[str, Any]:
        """A parameter's states as :meth:`state_dict` gives them (an NVMe unit's tensors are
        placeholders until read), each over only its own bytes."""
        master = slot.masters[position]
        values = dict(slot.inner.state.get(master, {}))
        if slot.widened(position) and id(master) not in self.stale:
            values["master"] = master.detach()
        return {k: compact(v) if torch.is_tensor(v) else v for k, v in values.items()}

    def _leave_facade(self, state: MutableMapping) -> None:
        """The facade is a plain optimizer again, holding ``state``."""
        self.facade.state = state  # type: ignore[assignment]  # a mapping that acts as the defaultdict(dict) torch declares
        self.on_zero_grad = lambda units: None
        for name in ("state_dict", "load_state_dict", "zero_grad"):
            self.facade.__dict__.pop(name, None)


def _read_into(held: list[tuple[int, int, dict[str, Any]]], read: StatesReader) -> Callable[[], dict[int, dict[str, Any]]]:
    """A function giving each (index, id of the master, values) of ``held`` its values, those the
    unit's file holds read from it (the others, a step count, as held)."""

    def states() -> dict[int, dict[str, Any]]:
        stored = read()
        return {index: {k: stored.get((master, None if k == "master" else k), v) for k, v in values.items()} for index, master, values in held}

    return states


def _plain_states(slot: UnitSlot, position: int, values: dict, read: dict[tuple[int, Optional[str]], torch.Tensor]) -> dict:
    """One parameter's states as plain training holds them: fp32 states of a low-precision
    parameter take its dtype; a tensor that owns its memory is taken as it is (the inner optimizer
    is done with it), any other is copied. ``read``: values read from the unit's file."""
    p, master = slot.params[position], slot.masters[position]
    cast = slot.widened(position)
    plain = {}
    for k, v in values.items():
        v = read.get((id(master), k), v)
        if torch.is_tensor(v):
            if cast and k != "step" and v.is_floating_point():
                v = v.to(p.dtype)
            elif v.untyped_storage().nbytes() != v.nbytes or v.storage_offset() != 0 or not v.is_contiguous():
                v = v.clone()
        plain[k] = v
    return plain


def _unit_states(slot: UnitSlot, read: StatesReader) -> Callable[[], dict[Any, dict]]:
    """A function giving the plain states of each parameter of the slot, read from the unit's
    file; it keeps the scalar states (a step count) the optimizer holds in memory, not the optimizer."""
    kept = [
        (p, position, {k: v.clone() if torch.is_tensor(v) and v.dim() == 0 else v for k, v in slot.inner.state.get(master, {}).items()})
        for position, (p, master) in enumerate(zip(slot.params, slot.masters))
    ]
    shell = UnitSlot.__new__(UnitSlot)  # the slot's parameters and masters only: no inner optimizer kept alive
    shell.params, shell.masters = list(slot.params), list(slot.masters)

    def states() -> dict[Any, dict]:
        values = read()
        return {p: _plain_states(shell, position, scalars, values) for p, position, scalars in kept if scalars}

    return states


class StatesReadOnUse(MutableMapping):
    """An optimizer's ``state`` after training where units' states stayed on NVMe: a parameter's
    entry is read from its unit's file the first time it is used (``optimizer.state_dict()``, a
    checkpoint, more training), with the rest of its unit, and held from then on as plain
    training holds it; the others are a ``defaultdict(dict)``'s."""

    def __init__(self) -> None:
        self.held: collections.defaultdict = collections.defaultdict(dict)
        self.pending: dict[int, tuple[Any, Callable[[], None]]] = {}  # id(parameter) -> (parameter, its unit's read)
        self._unread = False

    @contextlib.contextmanager
    def unread(self) -> Iterator[None]:
        """Iteration sees the states in memory only for the duration (Lightning's teardown moves
        every state it finds to the CPU: where they already are)."""
        self._unread = True
        try:
            yield
        finally:
            self._unread = False

    def defer(self, params: Sequence[Any], states: Callable[[], dict[Any, dict]]) -> None:
        def bring() -> None:
            for p, values in states().items():
                if self.pending.pop(id(p), None) is not None:  # not replaced or removed meanwhile
                    self.held[p] = values

        for p in params:
            self.pending[id(p)] = (p, bring)

    def _bring(self, p: Any) -> None:
        waiting = self.pending.get(id(p))
        if waiting is not None:
            waiting[1]()

    def __getitem__(self, p: Any) -> dict:
        self._bring(p)
        return self.held[p]

    def __setitem__(self, p: Any, value: dict) -> None:
        self.pending.pop(id(p), None)
        self.held[p] = value

    def __delitem__(self, p: Any) -> None:
        if self.pending.pop(id(p), None) is None:
            del self.held[p]

    def __contains__(self, p: object) -> bool:
        return id(p) in self.pending or p in self.held

    def __iter__(self) -> Iterator[Any]:
        yield from list(self.held)
        if not self._unread:
            yield from [p for p, _ in list(self.pending.values())]

    def __len__(self) -> int:
        return len(self.held) + (0 if self._unread else len(self.pending))

    def __repr__(self) -> str:
        return f"StatesReadOnUse({len(self.held)} parameters' states in memory, {len(self.pending)} on NVMe)"


class StatesToMove(Mapping):
    """A state dict's ``state`` on its way from one engine to the next (``UnitOptimizers.hand_over``):
    index -> a parameter's states, each handed over once and let go of as it is (what the next
    engine keeps elsewhere, on NVMe, is then freed); an NVMe unit's entries are read from its
    file together when the first of them is taken. So the next engine's ``load_state_dict``, which
    takes them unit by unit, holds one unit's states at a time beyond its own."""

    def __init__(self) -> None:
        self.ready: dict[int, dict[str, Any]] = {}
        self.pending: dict[int, Callable[[], None]] = {}  # index -> its unit's read

    def add(self, index: int, values: dict[str, Any]) -> None:
        self.ready[index] = values

    def defer(self, indices: Sequence[int], states: Callable[[], dict[int, dict[str, Any]]], now: bool = False) -> None:
        """``indices`` take their values from ``states()``, called once, when the first is taken (``now``: at once)."""

        def bring() -> None:
            for index, values in states().items():
                if self.pending.pop(index, None) is not None:
                    self.ready[index] = values

        for index in indices:
            self.pending[index] = bring
        if now and indices:
            bring()

    def __getitem__(self, index: int) -> dict[str, Any]:
        bring = self.pending.get(index)
        if bring is not None:
            bring()
        return self.ready.pop(index)

    def __contains__(self, index: object) -> bool:
        return index in self.ready or index in self.pending

    def __iter__(self) -> Iterator[int]:
        yield from list(self.ready)
        yield from list(self.pending)

    def __len__(self) -> int:
        return len(self.ready) + len(self.pending)

    def __repr__(self) -> str:
        return f"StatesToMove({len(self.ready)} parameters' states in memory, {len(self.pending)} to read)"


class LiveState(MutableMapping):
    """The facade's ``state`` during training: each parameter's entry is its unit optimizer's state
    for its master, the same dict and tensors, so that code reading or changing optimizer states
    (a callback logging Adam's moments, Lightning moving states between devices) sees and changes
    the real ones. An NVMe unit's states are lent on first read (see the engine)."""

    def __init__(self, units: "UnitOptimizers") -> None:
        self.units = units

    def _locate(self, p: Any) -> tuple[dict, torch.Tensor, int]:
        found = self.units.slot_of.get(id(p))
        if found is None:
            raise KeyError(p)
        slot, position = found
        return slot.inner.state, slot.masters[position], slot.unit_index

    def __getitem__(self, p: Any) -> dict:
        state, master, unit_index = self._locate(p)
        if master not in state:
            raise KeyError(p)
        self.units.lend_states(unit_index)
        return state[master]

    def __setitem__(self, p: Any, value: dict) -> None:
        state, master, unit_index = self._locate(p)
        self.units.lend_states(unit_index)
        state[master] = value
        self.units.states_replaced(unit_index, master)

    def __delitem__(self, p: Any) -> None:
        state, master, unit_index = self._locate(p)
        del state[master]
        self.units.states_replaced(unit_index, master)

    def __iter__(self) -> Iterator[Any]:
        for slot in self.units.all_slots():
            for p, master in zip(slot.params, slot.masters):
                if master in slot.inner.state:
                    yield p

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"LiveState({len(self)} parameters with states)"


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` over a storage of exactly its own bytes, sharing memory with it.

    torch.save writes a tensor's whole storage; a parameter or state that views a shared slab
    (a unit's home, the masters' region, an NVMe unit's buffer) would carry the whole slab into
    the checkpoint. A slice of the storage shares the memory and saves only what it holds.
    """
    if not torch.is_tensor(t) or t.numel() == 0 or not t.is_contiguous():
        return t
    storage = t.untyped_storage()
    start, nbytes = t.storage_offset() * t.element_size(), t.numel() * t.element_size()
    if start == 0 and storage.nbytes() == nbytes:
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage[start : start + nbytes], 0, t.shape, t.stride())


# Optimizers whose fused CPU kernel computes the same update as their default one, up to float32
# rounding: one pass over parameters, gradients and states instead of one per operation.
_FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def host_implementation(optimizer: torch.optim.Optimizer, exact: bool) -> dict[str, Any]:
    """The settings for units updated in host memory. ``exact``: the run must match plain
    training bit for bit (on the emulated GPU tier, where plain runs the same optimizer on the same
    CPU), so nothing changes. On a GPU plain updates on the GPU, and no host kernel rounds as it
    does; there the fused CPU kernel (about 5x the default's rate on two cores, docs/benchmarks.md)
    runs where the class has one and the user did not ask for a differentiable step."""
    if exact or type(optimizer) not in _FUSED_ON_CPU or any(g.get("differentiable") for g in optimizer.param_groups):
        return {}
    settings = {"fused": True, "foreach": False}
    if "capturable" in optimizer.defaults:
        settings["capturable"] = False  # a CUDA-graph setting: host tensors are never captured
    return {k: v for k, v in settings.items() if k in optimizer.defaults}


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (some classes add derived ones)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


@contextlib.contextmanager
def grads_on(masters: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]) -> Iterator[None]:
    """Attach ``grads`` to ``masters`` for one update (None: the optimizer skips that master)."""
    for m, g in zip(masters, grads):
        m.grad = g
    try:
        yield
    finally:
        for m in masters:
            m.grad = None
