"""A GPU tier of "all that is free" kept a guessed share of the GPU for what lives outside the plan.
Now the first collective runs before the budget is read (NCCL's buffers are no part of what is free),
and after the profiled steps the device's count of what its allocator reserved beyond its
allocations is set against that margin: where it is more, the tier gives up the difference, and the
budget line says the margin and why (``session/budgets.py::gpu_after_profiling``)."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from offload_strategy import TieredStrategy
from tests.helpers import PARAMETERS_ONLY, train
from tests.test_activations import gpt2

GIB, MIB = 2**30, 2**20


def test_a_measured_reserve_beyond_the_kept_margin_comes_off_the_tier():
    from offload_strategy.session.budgets import gpu_after_profiling

    gpu, line = gpu_after_profiling(70 * GIB, kept=4 * GIB, measured=5 * GIB, where="cuda:0")
    assert gpu == 69 * GIB
    assert "margin of 5.00 GiB" in line and "1.00 GiB more than the 4.00 GiB kept at set-up" in line
    gpu, line = gpu_after_profiling(70 * GIB, kept=4 * GIB, measured=300 * MIB, where="cuda:0")
    assert gpu == 70 * GIB and "within the 4.00 GiB kept" in line and "margin of 4.00 GiB" in line


class ReservesBeside(L.Callback):
    """The emulated device reports what a caching allocator would reserve beyond its allocations;
    the GPU tier's budget before the profiled steps and after training."""

    def __init__(self, reserve: int) -> None:
        self.reserve = reserve
        self.before = self.after = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.before = trainer.strategy.tiered.context.budgets.gpu

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # each engine's device (the parameters are placed again beside the kept layout after the first step)
        if trainer.strategy.engine is not None:
            trainer.strategy.engine.device.reserve = self.reserve

    def on_train_end(self, trainer, pl_module) -> None:
        self.after = trainer.strategy.tiered.context.budgets.gpu


def test_a_reserve_the_device_measured_in_the_profiled_steps_comes_off_a_gpu_tier_of_all_that_is_free(tmp_path, caplog):
    seen = ReservesBeside(256 * MIB)
    with caplog.at_level(logging.INFO):
        strategy = TieredStrategy(host_memory="1GiB", policy={**PARAMETERS_ONLY, "placement": "host"})  # an engine, though all would fit
        train(strategy, tmp_path, epochs=1, make_model=gpt2, extra_callbacks=(seen,), limit_train_batches=4, limit_val_batches=0)
    assert seen.before > 256 * MIB and seen.after == seen.before - 256 * MIB
    assert any("margin of 256.00 MiB" in r.getMessage() and "profiled steps" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
def test_the_cuda_device_counts_what_its_allocator_reserved_beyond_its_allocations():
    """To verify on a GPU (docs/gpu.md): the count the margin is checked against."""
    from offload_strategy.hardware.device import CudaDevice

    root = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats(root)
    with CudaDevice(root, capacity=0) as device:
        kept = [torch.empty(n, dtype=torch.uint8, device=root) for n in (3 * MIB + 1, 5 * MIB + 3)]
        del kept[0]
        measured = device.reserved_beyond_allocated()
        # the allocator rounds large blocks up to 2 MiB: 4 + 6 MiB reserved for 8 MiB and 4 bytes
        assert measured == torch.cuda.max_memory_reserved(root) - torch.cuda.max_memory_allocated(root) > 0
