"""Updates during backward under clipping by norm (runtime/updates/speculation.py): bit for bit plain
Lightning's, whether the norm stays under the threshold, exceeds it, or both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from offload_strategy import TieredStrategy
from offload_strategy.runtime.updates.speculation import SpeculativeUpdates
from tests.helpers import assert_same_weights
from tests.test_recipes import Net, fit, tiered

STEPS = 6


class _Slot:
    """A unit of one fp32 master under Adam, as the updater hands it over."""

    def __init__(self, value: list[float]) -> None:
        self.unit_index = 0
        self.masters = [torch.tensor(value)]
        self.params = self.masters
        self.inner = torch.optim.Adam(self.masters, lr=0.1)

    def widened(self, position: int) -> bool:
        return False

    def step(self, grad: list[float]) -> None:
        self.masters[0].grad = torch.tensor(grad)
        self.inner.step()
        self.masters[0].grad = None


def test_previous_values_come_back_exactly_with_the_states_as_they_were():
    """Worked by hand: Adam's first step moves each element by lr against its gradient's sign
    (1, 2 with gradients 0.5, -0.5 become 0.9, 2.1) and creates its states; taken back, the master
    is 1, 2 again and the states are gone; after a kept step, a second is taken back to it."""
    slot = _Slot([1.0, 2.0])
    speculation = SpeculativeUpdates()
    speculation.begin_step(True)
    speculation.save(slot, slot.masters)
    slot.step([0.5, -0.5])
    assert torch.allclose(slot.masters[0], torch.tensor([0.9, 2.1]))
    assert speculation.settle(True, _Optimizers(slot), lambda index: slot.masters) == [0]
    assert torch.equal(slot.masters[0], torch.tensor([1.0, 2.0])) and not slot.inner.state.get(slot.masters[0])

    slot.step([0.5, -0.5])  # the step made again after backward, with the clipped gradient
    kept = slot.masters[0].clone()
    kept_states = {k: v.clone() for k, v in slot.inner.state[slot.masters[0]].items()}
    assert not speculation.begin_step(True), "a step after one that clipped speculates"
    assert speculation.settle(False, _Optimizers(slot), lambda index: slot.masters) == []
    assert speculation.begin_step(True)  # the last step kept under the threshold
    speculation.save(slot, slot.masters)
    slot.step([1.0, 1.0])
    assert speculation.settle(True, _Optimizers(slot), lambda index: slot.masters) == [0]
    assert torch.equal(slot.masters[0], kept)
    assert all(torch.equal(slot.inner.state[slot.masters[0]][k], v) for k, v in kept_states.items())
    assert not speculation.begin_step(True), "a step after one that clipped speculates"


class _Optimizers:
    def __init__(self, slot: _Slot) -> None:
        self.slots = {0: slot}


class _Norms(L.Callback):
    """Plain training's total gradient norm each step, before clipping."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.values.append(float(torch.nn.utils.get_total_norm(grads)))


def _expected_redone(norms: list[float], threshold: float) -> int:
    """A step speculates unless the one before clipped; a speculating step that clips is redone."""
    redone, clipped_last = 0, False
    for norm in norms:
        clips = threshold / (norm + 1e-6) < 1.0
        redone += clips and not clipped_last
        clipped_last = clips
    return redone


def _fit_both(tmp_path: Path, strategy: TieredStrategy, threshold: float, **kwargs: Any) -> dict[str, float]:
    plain_losses, plain_weights, _ = fit("auto", tmp_path / "plain", Net, steps=STEPS, gradient_clip_val=threshold, **kwargs)
    losses, weights, _ = fit(strategy, tmp_path / "tiered", Net, steps=STEPS, gradient_clip_val=threshold, **kwargs)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    return strategy.metrics()


@pytest.fixture(scope="module")
def plain_norms(tmp_path_factory) -> list[float]:
    norms = _Norms()
    fit("auto", tmp_path_factory.mktemp("norms"), Net, steps=STEPS, gradient_clip_val=1e9, callbacks=(norms,))
    return norms.values


def test_under_the_threshold_every_host_unit_is_updated_in_backward_and_kept(tmp_path, plain_norms):
    metrics = _fit_both(tmp_path, tiered("host", tmp_path), threshold=10 * max(plain_norms))
    assert metrics["optimizer/speculated_units"] == 7 and metrics["optimizer/speculation_redone_steps"] == 0
    assert metrics["memory/speculation_bytes"] > 0


def test_above_the_threshold_the_first_step_is_redone_and_the_next_wait(tmp_path, plain_norms):
    metrics = _fit_both(tmp_path, tiered("host", tmp_path), threshold=min(plain_norms) / 10)
    assert metrics["optimizer/speculation_redone_steps"] == 1 and metrics["optimizer/speculated_units"] == 0


def test_a_threshold_some_steps_exceed_redoes_exactly_those_that_speculated(tmp_path, plain_norms):
    threshold = sorted(plain_norms)[len(plain_norms) // 2]
    expected = _expected_redone(plain_norms, threshold)
    assert 0 < expected < STEPS, plain_norms
    metrics = _fit_both(tmp_path, tiered("host", tmp_path), threshold=threshold)
    assert metrics["optimizer/speculation_redone_steps"] == expected


def test_with_16_bit_parameters_the_copies_forward_reads_come_back_too(tmp_path, plain_norms):
    """Under bf16-true each host unit's update writes its fp32 masters and the bf16 copies forward
    computes with: a redone step puts both back. Compared with the same run updating after backward."""
    threshold = sorted(plain_norms)[len(plain_norms) // 2]
    ahead = tiered("host", tmp_path / "a")
    after = tiered("host", tmp_path / "b", update_during_backward=False)
    losses, weights, _ = fit(ahead, tmp_path / "ahead", Net, steps=STEPS, gradient_clip_val=threshold, precision="bf16-true")
    waited_losses, waited_weights, _ = fit(after, tmp_path / "after", Net, steps=STEPS, gradient_clip_val=threshold, precision="bf16-true")
    assert losses == waited_losses
    assert_same_weights(waited_weights, weights)
    assert ahead.metrics()["optimizer/speculation_redone_steps"] >= 1
    assert "optimizer/speculation_redone_steps" not in after.metrics(), {k: v for k, v in after.metrics().items() if "specul" in k}


def test_previous_values_take_no_more_than_the_host_budget_leaves(tmp_path, plain_norms):
    """With room for a few units' previous values only, those units speculate and the others are
    updated after backward; the run is still plain Lightning's."""
    seen: list[tuple[int, int]] = []

    class Room(L.Callback):
        def on_train_batch_end(self, trainer, *args: Any) -> None:
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                seen.append((engine.speculation.held_bytes, engine.speculation.room))

    # the host budget: what the plan keeps there (392 KiB), and room for about half of the units' previous values
    total = sum(p.numel() * p.element_size() for p in Net().parameters())
    strategy = TieredStrategy(policy={"placement": "host", "activations": "keep"}, gpu_memory="1MiB", host_memory=392 * 1024 + int(1.5 * total))
    metrics = _fit_both(tmp_path, strategy, threshold=10 * max(plain_norms), callbacks=(Room(),))
    assert 0 < metrics["optimizer/speculated_units"] < 7
    assert seen and all(0 < held <= room for held, room in seen), seen
