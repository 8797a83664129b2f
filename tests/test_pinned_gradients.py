"""Gradients the placement did not plan land in pinned host memory, as the planned ones do: the
homes of parameters unfrozen after set-up (a callback's or a training step's ``requires_grad_(True)``)
and gradient buffers taken beyond the plan's. (A finetuning callback that unfreezes at an epoch's
start, as Lightning's ``BackboneFinetuning`` does, is placed again before that epoch's first step:
late homes hold the gradients of what is unfrozen inside a step or between its micro-batches.) They were pageable tensors, and on
CUDA a copy out of the GPU tier into pageable memory is synchronous (the host waits for all that
is queued) and overlaps nothing. The emulated tier pins nothing (no CUDA), so a copy's host side
is checked to lie in a slab the engine holds, which CUDA registers: the tiers' slab, where the
plan laid out room for every parameter of a partly trainable unit, or the pinned overflow
(``runtime/grads/overflow.py``), counted in the engine's host bytes within the host budget. Each
run copies gradients home as on CUDA and trains as plain Lightning does, bit for bit."""

from __future__ import annotations

import logging
import re
from typing import Optional

import lightning as L
import pytest
import torch

from offload_strategy.hardware.device import Device
from offload_strategy.lightning.core import TieredCore
from offload_strategy.planning.placement import HOST, PlacementError
from offload_strategy.runtime.grads.buffers import GradientBuffers, gradient_bytes
from offload_strategy.runtime.grads import overflow as overflow_module
from offload_strategy.runtime.grads.overflow import GradientOverflow
from tests.helpers import assert_same_weights
from tests.test_gradient_buffers import unit_state
from tests.test_recipes import PLACEMENTS, Net, fit, tiered

# gradients copied home as on CUDA (the emulated tier's default writes them at home in place)
COPIED_HOME = {"gradient_reserve": 1.0}


def _inside(t: torch.Tensor, region: torch.Tensor) -> bool:
    start, base = t.data_ptr(), region.data_ptr()
    return base <= start and start + t.numel() * t.element_size() <= base + region.numel()


class GradientCopies(L.Callback):
    """Where each copy out of the GPU tier lands: in the engine's ``slab``, its ``overflow``, or
    ``pageable`` memory; and per batch end, the engine, its host bytes and the overflow's."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.trainer: Optional[L.Trainer] = None
        self.landed: list[str] = []
        self.held: list[tuple[int, int, int]] = []
        copy_to_host = Device.copy_to_host

        def copying(device: Device, dst: torch.Tensor, src: torch.Tensor):
            self.landed.append(self.where(dst))
            return copy_to_host(device, dst, src)

        monkeypatch.setattr(Device, "copy_to_host", copying)

    def setup(self, trainer, pl_module, stage) -> None:
        self.trainer = trainer

    def where(self, dst: torch.Tensor) -> str:
        assert self.trainer is not None
        engine = self.trainer.strategy.engine
        if _inside(dst, engine.memory.slab.tensor) or engine.gradients.staging.contains(dst):
            return "slab"  # the tiers' slab, or the pieces a later micro-batch's gradient crosses
        overflow = getattr(engine.gradients.buffers, "overflow", None)
        return "overflow" if overflow is not None and overflow.contains(dst) else "pageable"

    def on_train_batch_end(self, trainer, *args) -> None:
        engine = trainer.strategy.engine
        overflow = getattr(engine.gradients.buffers, "overflow", None)
        self.held.append((id(engine), engine.host_bytes_held(), overflow.nbytes if overflow is not None else 0))


@pytest.fixture(scope="module")
def plain_runs() -> dict:
    """Plain Lightning's run of each recipe, once for both placements (the callbacks keep no state)."""
    return {}


def _assert_pinned_and_like_plain(plain_runs: dict, tmp_path, monkeypatch, placement: str, make, callbacks=tuple, **kwargs) -> GradientCopies:
    if make not in plain_runs:
        plain_runs[make] = fit("auto", tmp_path / "plain", make, callbacks=callbacks(), **kwargs)
    plain_losses, plain_weights, _ = plain_runs[make]
    copies = GradientCopies(monkeypatch)
    losses, weights, _ = fit(tiered(placement, tmp_path, **COPIED_HOME), tmp_path / "tiered", make, callbacks=(*callbacks(), copies), **kwargs)
    assert copies.landed and "pageable" not in copies.landed, copies.landed
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    L.seed_everything(7, verbose=False)  # as ``fit`` seeds: the unfrozen blocks trained once unfrozen
    initial = make().state_dict()
    assert all(not torch.equal(weights[f"blocks.{k}.weight"], initial[f"blocks.{k}.weight"]) for k in (1, 2))
    return copies


class FrozenBlocks(Net):
    """The blocks frozen when the strategy places the model (units without a gradient home); the
    optimizer has every parameter."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        self.blocks.requires_grad_(False)
        return optimizer


class UnfreezeBetweenMicroBatches(L.Callback):
    """Unfreezes the blocks at the fourth batch: the second micro-batch of the second step (of three)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 3:
            pl_module.blocks.requires_grad_(True)


ACCUMULATING = dict(callbacks=lambda: (UnfreezeBetweenMicroBatches(),), accumulate_grad_batches=2, steps=3)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_blocks_a_callback_unfreezes_between_micro_batches_copy_their_gradients_into_pinned_memory(plain_runs, tmp_path, monkeypatch, placement):
    """Until the step ends and the model is placed again with their gradients, the unfrozen
    blocks' gradients land in the pinned overflow, which the engine's host bytes count."""
    copies = _assert_pinned_and_like_plain(plain_runs, tmp_path, monkeypatch, placement, FrozenBlocks, **ACCUMULATING)
    assert "overflow" in copies.landed
    late = [k for k, (_, _, overflow) in enumerate(copies.held) if overflow]
    assert late == [3], copies.held
    before, now = copies.held[2], copies.held[3]  # the batch before, the same engine: its host bytes grew by the overflow's
    assert before[0] == now[0] and now[1] - before[1] == now[2] == 4 * 8192, copies.held


class UnfreezeInStep(Net):
    """Block 1's weight frozen at first (its bias trains: the unit has a gradient home) and block 2
    wholly (a unit without one), both unfrozen inside the third training step."""

    def configure_optimizers(self):
        self.blocks[1].weight.requires_grad_(False)
        self.blocks[2].requires_grad_(False)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            self.blocks[1].weight.requires_grad_(True)
            self.blocks[2].requires_grad_(True)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_parameters_unfrozen_inside_a_step_take_their_place_in_the_slab_or_the_overflow(plain_runs, tmp_path, monkeypatch, placement):
    """A unit partly trainable at set-up has gradient memory laid out for every parameter (a home
    in the slab, or on NVMe buffers): its weight unfrozen later takes its place there; only the
    unit frozen whole takes a home (8 KiB) from the overflow."""
    copies = _assert_pinned_and_like_plain(plain_runs, tmp_path, monkeypatch, placement, UnfreezeInStep, steps=4)
    assert {"slab", "overflow"} == set(copies.landed)
    assert [overflow for _, _, overflow in copies.held] == [0, 0, 8192, 0], copies.held


def test_late_gradient_homes_beyond_the_host_budget_are_refused_with_the_numbers(tmp_path, monkeypatch):
    """What the host budget leaves beside the placement (here made 20 KiB) cannot hold the four
    blocks' gradient homes (8 KiB each, page-aligned)."""
    monkeypatch.setattr(TieredCore, "_host_room", lambda self, placed: 20 * 1024)
    with pytest.raises(PlacementError, match=r"the gradients of unit 'blocks\.2', unfrozen after set-up, need 8\.00 KiB of pinned host "
                                             r"memory the placement did not plan, beside 16\.00 KiB already taken so; host_memory leaves "
                                             r"20\.00 KiB .* Raise host_memory by at least 4\.00 KiB") as raised:
        fit(tiered("host", tmp_path, **COPIED_HOME), tmp_path / "tiered", FrozenBlocks, callbacks=(UnfreezeBetweenMicroBatches(),),
            accumulate_grad_batches=2, steps=3)
    assert raised.value.tier is HOST


def test_gradient_buffers_beyond_the_plan_come_from_the_overflow_and_are_reused(caplog):
    """With every buffer held and none on its way back, a unit's buffer comes from the pinned
    overflow, as large as the pool's, counted there, and is reused once given back; past the
    overflow's room it is taken all the same, with one warning naming the bytes (gradients that
    wait for their reductions must land: refusing mid-step stopped a tiered_ddp run whose
    shared-homes ranks held buffers past a tight host budget)."""
    states = [unit_state(i) for i in range(4)]
    size = gradient_bytes(states[0])
    overflow = GradientOverflow(pin=False)
    buffers = GradientBuffers([torch.empty(size, dtype=torch.uint8)], overflow)
    buffers.acquire(states[0])
    extra = buffers.acquire(states[1])
    assert buffers.extra == 1 and overflow.contains(extra) and extra.numel() == size and overflow.nbytes == size
    buffers.release(states[1])
    again = buffers.acquire(states[2])
    assert again.data_ptr() == extra.data_ptr() and overflow.nbytes == size  # reused, nothing more taken
    overflow.room = lambda: size + 100
    with caplog.at_level(logging.WARNING, logger=overflow_module.__name__):
        past = buffers.acquire(states[3])
        buffers.acquire(unit_state(4))  # past the room again: said once
    assert overflow.contains(past) and overflow.nbytes == 3 * size
    warned = [r.getMessage() for r in caplog.records if r.name == overflow_module.__name__]
    assert len(warned) == 1 and re.search(r"a gradient buffer beyond the plan's 1 \(for 'u3'\) need 4\.00 KiB .* beside 4\.00 KiB", warned[0])
    overflow.close()
    assert overflow.nbytes == 0


def test_an_engine_without_a_budget_takes_late_homes_without_a_bound():
    """Built by hand (no core, no host budget): the overflow has no room to check."""
    overflow = GradientOverflow(pin=False)
    taken = overflow.take(1 << 20, "a test's gradients")
    assert taken.numel() == 1 << 20 and overflow.contains(taken) and not overflow.contains(torch.empty(4))
    assert overflow.give_back(taken) and not overflow.give_back(torch.empty(4))
    overflow.close()


def test_the_overflows_room_may_count_what_the_overflow_holds():
    """The core's room reads the host left to the activations' swaps, which counts the engine's
    host bytes, the overflow's among them: it is asked outside the overflow's lock."""
    overflow = GradientOverflow(pin=False)
    overflow.room = lambda: 3 * 4096 - overflow.nbytes
    first = overflow.take(4096, "a test's gradients")
    with pytest.raises(PlacementError, match=r"need 8\.00 KiB .* beside 4\.00 KiB already taken so; host_memory leaves 8\.00 KiB"):
        overflow.take(8192, "a test's gradients")
    assert overflow.contains(first) and overflow.nbytes == 4096
    overflow.close()
