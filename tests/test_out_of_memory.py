"""A CUDA out-of-memory error in a training step is told against the plan: what the plan holds in
the GPU tier, what PyTorch held, and the gpu_memory that leaves room for the rest."""

from __future__ import annotations

import pytest
import torch

from offload_strategy import TieredStrategy
from offload_strategy.planning.activations import BesideBlocks
from offload_strategy.runtime.out_of_memory import AllocatorUse, PlannedUse, out_of_memory_message
from tests import test_recipes as recipes

MiB = 2**20
TORCH_SAYS = ("CUDA out of memory. Tried to allocate 786.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which 123.57 GiB is free. "
              "Including non-PyTorch memory, this process has 16.23 GiB memory in use.")


def test_the_message_names_the_plan_what_pytorch_held_and_the_budget_that_leaves_room():
    """By hand: 4 MiB for the parameters and a 10 MiB activation peak in a 16 MiB tier; PyTorch
    had 20 MiB reserved, 6 MiB beyond the plan's 14: a tier of 10 MiB leaves room for it."""
    plan = PlannedUse(budget=16 * MiB, parameters=4 * MiB, activations=10 * MiB, beside=BesideBlocks(outside=MiB, gradients=2 * MiB))
    text = out_of_memory_message(TORCH_SAYS, plan, AllocatorUse(allocated=15 * MiB, reserved=20 * MiB, peak=19 * MiB))
    assert text.startswith("CUDA out of memory. Tried to allocate 786.00 MiB in a training step under strategy='tiered'.")
    assert "4.00 MiB for the parameters" in text and "10.00 MiB of activations at their planned peak" in text
    assert "(of it, 1.00 MiB of activations outside the blocks and 2.00 MiB for the backward's gradients)" in text
    assert "in gpu_memory=16.00 MiB" in text
    assert "15.00 MiB allocated and 20.00 MiB reserved when it failed (peak 19.00 MiB allocated): 6.00 MiB reserved beyond the plan" in text
    assert "Lower gpu_memory by that, to 10.00 MiB" in text
    # before the first steps have measured the activations, and with PyTorch's figures unknown
    early = out_of_memory_message(TORCH_SAYS, PlannedUse(budget=16 * MiB, parameters=4 * MiB), None)
    assert "no plan of its activations" in early and "Lower gpu_memory (or the batch size)" in early


class RunsOutAtStep(recipes.Net):
    """A CUDA out-of-memory error at the fifth step, in the forward or in the backward."""

    where = "forward"

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == 4:
            self.trainer.strategy.streamed = self.trainer.strategy.engine is not None
            if self.where == "forward":
                raise torch.OutOfMemoryError(TORCH_SAYS)
            return OutInBackward.apply(loss)
        return loss


class OutInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError(TORCH_SAYS)


class RunsOutInBackward(RunsOutAtStep):
    where = "backward"


@pytest.mark.parametrize("make", [RunsOutAtStep, RunsOutInBackward], ids=["forward", "backward"])
@pytest.mark.parametrize("offloads", [True, False], ids=["units_offloaded", "everything_fits"])
def test_an_out_of_memory_error_in_a_step_is_told_against_the_plan(tmp_path, make, offloads):
    """The planned layout's peak and the budget, in the forward and the backward, with and without
    an engine streaming units (the message used to be PyTorch's alone)."""
    budget = "300KiB" if offloads else "64MiB"
    strategy = TieredStrategy(gpu_memory=budget, host_memory="1GiB")
    with pytest.raises(torch.OutOfMemoryError) as caught:
        recipes.fit(strategy, tmp_path, make, steps=6)
    text = str(caught.value)
    assert text.startswith("CUDA out of memory. Tried to allocate 786.00 MiB in a training step under strategy='tiered'.")
    assert "of activations at their planned peak" in text and f"in gpu_memory={'300.00 KiB' if offloads else '64.00 MiB'}" in text
    assert strategy.streamed == offloads
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError) and str(caught.value.__cause__) == TORCH_SAYS
