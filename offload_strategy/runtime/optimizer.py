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

import contextlib
import inspect
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

# Optimizers whose step re-evaluates the model through a closure, which a unit cannot do alone.
WHOLE_MODEL_OPTIMIZERS = ("LBFGS",)


def check_per_parameter(optimizer: torch.optim.Optimizer) -> None:
    name = type(optimizer).__name__
    if name in WHOLE_MODEL_OPTIMIZERS:
        raise ValueError(
            f"{name} re-evaluates the whole model inside its step, so it cannot update offloaded units one at a time; "
            f"use a per-parameter optimizer (AdamW, Adam, SGD, ...), or raise gpu_memory so that nothing is offloaded."
        )


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
    """Inner optimizers of one facade, one per unit, and the facade's standard state dict."""

    def __init__(self, facade: torch.optim.Optimizer, units: Sequence[tuple[int, list[nn.Parameter], list[torch.Tensor]]]) -> None:
        """``units``: (unit index, its trainable parameters, their masters) for every unit."""
        check_per_parameter(facade)
        self.facade = facade
        group_of_param = {id(p): g for g, group in enumerate(facade.param_groups) for p in group["params"]}
        self.order = [p for group in facade.param_groups for p in group["params"]]  # facade order = state-dict indices
        self.slots: dict[int, UnitSlot] = {}
        self.slot_of: dict[int, tuple[UnitSlot, int]] = {}  # id(param) -> (slot, position)
        # fp32 masters whose value is still the parameter's: taken from it right before their update
        self.stale: set[int] = set()
        for unit_index, params, masters in units:
            chosen = [(p, m) for p, m in zip(params, masters) if id(p) in group_of_param]
            if not chosen:
                continue
            params = [p for p, _ in chosen]
            masters = [m for _, m in chosen]
            group_of = [group_of_param[id(p)] for p in params]
            inner_groups = sorted(set(group_of))
            groups = [
                {**{k: v for k, v in facade.param_groups[g].items() if k != "params"}, "params": [m for m, gg in zip(masters, group_of) if gg == g]}
                for g in inner_groups
            ]
            inner = type(facade)(groups, **_constructor_defaults(facade))
            slot = UnitSlot(unit_index, params, masters, group_of, inner, inner_groups)
            self.slots[unit_index] = slot
            for position, p in enumerate(params):
                self.slot_of[id(p)] = (slot, position)
        self._patch_facade()

    # -- stepping -----------------------------------------------------------------------------------

    def sync_hyperparameters(self, slot: UnitSlot) -> None:
        """Copy what schedulers and users changed on the facade (lr, weight decay, ...) to the unit."""
        for inner_group, g in zip(slot.inner.param_groups, slot.inner_groups):
            for key, value in self.facade.param_groups[g].items():
                if key != "params":
                    inner_group[key] = value

    def step(self, unit_index: int) -> None:
        slot = self.slots[unit_index]
        self.sync_hyperparameters(slot)
        slot.inner.step()

    def count_step(self) -> None:
        """Run the facade's own step over no parameters: its step hooks and the counters LR
        schedulers check see one step, and nothing is updated twice."""
        saved = [group["params"] for group in self.facade.param_groups]
        try:
            for group in self.facade.param_groups:
                group["params"] = []
            self.facade.step()
        finally:
            for group, params in zip(self.facade.param_groups, saved):
                group["params"] = params

    # -- state dict in the facade's standard format --------------------------------------------------

    def state_dict(self, materialize: Callable[[], contextlib.AbstractContextManager]) -> dict[str, Any]:
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
        groups = torch.optim.Optimizer.state_dict(self.facade)["param_groups"]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a standard state dict (from plain training or from us) into the inner optimizers."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.facade.param_groups):
            raise ValueError(f"the state dict has {len(groups)} param groups, the optimizer {len(self.facade.param_groups)}.")
        # hyperparameters (lr, initial_lr, ...) go to the facade, as torch does
        torch.optim.Optimizer.load_state_dict(self.facade, {"state": {}, "param_groups": groups})
        saved = {int(k): v for k, v in state_dict["state"].items()}
        index_of = {id(p): i for i, p in enumerate(self.order)}
        for slot in self.slots.values():
            inner_state: dict[int, Any] = {}
            masters: dict[int, torch.Tensor] = {}
            for position, p in enumerate(slot.params):
                index = index_of[id(p)]
                if index in saved:
                    values = dict(saved[index])
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

    @staticmethod
    def _inner_position(slot: UnitSlot, position: int) -> int:
        """Index of a master in the inner optimizer's own state-dict numbering."""
        master = slot.masters[position]
        flat = [m for group in slot.inner.param_groups for m in group["params"]]
        return next(i for i, m in enumerate(flat) if m is master)

    # -- the facade's methods ----------------------------------------------------------------------

    def _patch_facade(self) -> None:
        self._materialize: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        units = self

        def state_dict(facade: torch.optim.Optimizer) -> dict[str, Any]:
            return units.state_dict(units._materialize)

        def load_state_dict(facade: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
            units.load_state_dict(state_dict)
            units.after_load()

        self.after_load: Callable[[], None] = lambda: None
        # where a loaded fp32 master goes: into the master's memory (an NVMe unit's master has
        # none between updates, so the engine binds it to the value until it offloads it)
        self.set_master: Callable[[torch.Tensor, torch.Tensor], None] = lambda master, value: master.copy_(value)
        self.facade.state_dict = types.MethodType(state_dict, self.facade)  # type: ignore[method-assign]
        self.facade.load_state_dict = types.MethodType(load_state_dict, self.facade)  # type: ignore[method-assign]

    def restore_facade(self, materialize: Callable[[], contextlib.AbstractContextManager]) -> None:
        """End of training: the facade holds the real states of its own parameters, as after plain training."""
        with materialize():
            for slot in self.slots.values():
                for position, (p, master) in enumerate(zip(slot.params, slot.masters)):
                    values = slot.inner.state.get(master)
                    if values:
                        # fp32 states of a low-precision parameter take its dtype, as plain training has them
                        cast = slot.widened(position)
                        self.facade.state[p] = {
                            k: (v.to(p.dtype) if cast and k != "step" and v.is_floating_point() else v.clone()) if torch.is_tensor(v) else v
                            for k, v in values.items()
                        }
        for name in ("state_dict", "load_state_dict"):
            self.facade.__dict__.pop(name, None)


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
