"""A unit at home on NVMe makes its optimizer states, at its first update, in the staging buffer
they are stored from (``runtime/updates/nvme_states.py::StatesMadeInBuffer``): memory host_memory
counts. Before, the optimizer made them as fresh tensors of the heap (twice the unit under Adam,
beside the buffer they were then copied into), the first step's largest allocation beyond the
budgets (docs/benchmarks.md, "Optimizer states made in their buffer")."""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch

from offload_strategy.runtime.updates.nvme_states import NvmeOptimizerStates, StatesMadeInBuffer
from tests.test_recipes import Net, fit, tiered


class Places:
    """Where each state tensor (and master) of a unit's optimizer was right after its step:
    inside the engine's host slab or not, per step of each inner optimizer."""

    def __init__(self) -> None:
        self.slab: Optional[Callable[[], torch.Tensor]] = None
        self.inside: list[bool] = []  # one per tensor, in the order the steps saw them

    def record(self, optimizer: torch.optim.Optimizer) -> None:
        if self.slab is None:
            return
        slab = self.slab()
        low, high = slab.data_ptr(), slab.data_ptr() + slab.numel()
        for group in optimizer.param_groups:
            for p in group["params"]:
                tensors = [p] + [v for v in optimizer.state[p].values() if torch.is_tensor(v) and v.dim() > 0]
                self.inside += [low <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= high for t in tensors]


PLACES = Places()


class WatchedAdamW(torch.optim.AdamW):
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        PLACES.record(self)
        return loss


class WatchedSGD(torch.optim.SGD):  # its momentum is made by a clone of the gradient, not zeros_like
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        PLACES.record(self)
        return loss


class AdamNet(Net):
    def configure_optimizers(self) -> Any:
        return WatchedAdamW(self.parameters(), lr=1e-2)


class SgdNet(Net):
    def configure_optimizers(self) -> Any:
        return WatchedSGD(self.parameters(), lr=1e-2, momentum=0.9)


@pytest.fixture
def places():
    PLACES.slab, PLACES.inside = None, []
    yield PLACES
    PLACES.slab, PLACES.inside = None, []


@pytest.mark.parametrize("make", [AdamNet, SgdNet], ids=["adamw", "sgd-momentum"])
def test_the_first_steps_states_are_made_in_the_counted_buffer(tmp_path, places, make):
    strategy = tiered("nvme", tmp_path)
    places.slab = lambda: strategy.engine.memory.slab.tensor
    fit(strategy, tmp_path / "tiered", make, steps=2)
    assert len(places.inside) > 3 * len(list(make().parameters()))  # every parameter's, both steps
    assert all(places.inside), f"{places.inside.count(False)} of {len(places.inside)} masters and states outside the host slab"


def test_fp32_masters_of_a_first_step_are_made_in_the_buffer_too(tmp_path, places):
    strategy = tiered("nvme", tmp_path)
    places.slab = lambda: strategy.engine.memory.slab.tensor
    fit(strategy, tmp_path / "tiered", AdamNet, steps=2, precision="bf16-true")
    assert places.inside and all(places.inside)


def _adamw_step(made_before: int) -> tuple[torch.optim.Optimizer, torch.nn.Parameter, torch.Tensor, StatesMadeInBuffer]:
    """One AdamW step of a fresh parameter under ``StatesMadeInBuffer``, ``made_before``
    temporaries made like the parameter first."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 16))
    p.grad = torch.randn(8, 16)
    optimizer = torch.optim.AdamW([p], lr=0.1)
    buffer = torch.zeros(4096, dtype=torch.uint8)
    with StatesMadeInBuffer(buffer) as made:
        for _ in range(made_before):
            torch.zeros_like(p)
        optimizer.step()
    return optimizer, p, buffer, made


def test_states_made_in_the_buffer_are_where_the_layout_puts_them():
    """AdamW's two states are made in the buffer where ``learn`` lays them out: nothing to copy,
    the values those of a step outside the mode. A temporary made like the parameter before them
    takes room there too: the states after it are out of place, and the layout copies them in."""
    torch.manual_seed(0)
    reference = torch.nn.Parameter(torch.randn(8, 16))
    reference.grad = torch.randn(8, 16)
    plain = torch.optim.AdamW([reference], lr=0.1)
    plain.step()
    store = NvmeOptimizerStates(store=None)  # type: ignore[arg-type]  # nothing is read or written here
    for before, in_place in ((0, True), (1, False)):
        optimizer, p, buffer, made = _adamw_step(before)
        assert made.made == 2 + before
        assert store.learn(optimizer, before, [p]) == 4096  # two states of 512 bytes, a page
        assert store.in_place(before, buffer) is in_place
        assert torch.equal(p.detach(), reference.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], plain.state[reference][key])
