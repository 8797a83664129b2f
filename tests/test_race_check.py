"""The emulated device with CUDA's ordering kept as books (``RaceCheck``): copies land late, and a
host access to a buffer a copy may still use, before the host waited for it, raises."""

from __future__ import annotations

import gc
import time

import lightning as L
import pytest
import torch

from torch.multiprocessing.reductions import StorageWeakRef

from offload_strategy.hardware.device import RACE_CHECK_ENV, CopyRaceError, EmulatedDevice, RaceCheck
from offload_strategy import TieredStrategy
from tests.ddp_job import kept_peak
from tests.helpers import PARAMETERS_ONLY, assert_same_weights, train
from tests.test_offload import beside_kept, gpt2_4l, param_bytes

# a frozen block keeps 177.5 KiB of activations at this batch, a trainable one 225.5 KiB (measured in the first step)
FROZEN_BLOCK_KEEPS_LESS = 48 * 1024


def kept_peak_frozen(frozen_blocks: int) -> int:
    """The kept layout's peak of ``gpt2_4l`` with ``frozen_blocks`` of its blocks frozen."""
    return kept_peak(4) - frozen_blocks * FROZEN_BLOCK_KEEPS_LESS


def test_a_buffer_is_free_to_the_host_only_once_the_host_waited_for_its_copy():
    with EmulatedDevice(1 << 20, race_check=RaceCheck(max_delay_s=0.01, seed=1)) as device:
        staging, home = torch.arange(256, dtype=torch.uint8), torch.empty(256, dtype=torch.uint8)
        target = device.allocate(256)
        event = device.copy_to_device(target, staging)
        device.wait(event)  # compute sees the copy; the host has not waited for it
        with pytest.raises(CopyRaceError, match=r"releases a staging slot \(256 bytes.*host-to-device copy issued at tests/test_race_check.py:\d+ .*may still read it"):
            device.check_host_access(staging, "releases a staging slot")
        device.check_host_access(home, "writes a home")  # untouched by any copy
        later = device.copy_to_device(target, home)
        device.host_wait(later)  # the same stream: the earlier copy has landed too
        device.check_host_access(staging, "releases a staging slot")
        assert torch.equal(target, home)


def test_a_copy_issued_after_compute_waited_for_another_orders_it_for_the_host():
    with EmulatedDevice(1 << 20, race_check=RaceCheck(seed=2)) as device:
        source, target, back = torch.ones(64, dtype=torch.uint8), device.allocate(64), torch.empty(64, dtype=torch.uint8)
        device.wait(device.copy_to_device(target, source))
        device.host_wait(device.copy_to_host(back, target))  # queued behind the compute that waited
        device.check_host_access(source, "writes the source")


class Checked(L.Callback):
    """Whether the engine's device kept the race check's books, and how many units were on NVMe."""

    def __init__(self) -> None:
        self.race_checked, self.nvme_units = False, 0.0

    def on_train_batch_end(self, trainer, *args) -> None:
        engine = trainer.strategy.engine
        if engine is None and trainer.global_step <= 1:
            return  # everything fits the whole tier while the first step measures the kept layout: offloading starts after it
        self.race_checked = engine.device.race_check is not None
        self.nvme_units = trainer.strategy.metrics()["units/nvme"]


def _model(frozen: bool):
    def make():
        model = gpt2_4l()
        if frozen:  # a LoRA base's case: no gradient event orders anything for these units
            model.configure_model()
            model.model.transformer.h.requires_grad_(False)
        return model

    return make


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen_blocks"])
def test_nvme_staging_slots_are_released_and_refilled_only_after_their_copies(tmp_path, monkeypatch, frozen):
    """Every unit streamed from NVMe under the race check (turned on in make_device by the
    environment). A staging slot's copy into the GPU tier was waited for on the device only; the
    slot was then released and refilled from NVMe while (on CUDA) that copy could still be queued:
    the race check raised at the release. Training is plain Lightning's, bit for bit."""
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=_model(frozen))
    monkeypatch.setenv(RACE_CHECK_ENV, "3")
    total, checked = param_bytes(gpt2_4l), Checked()
    gpu_memory = beside_kept(0.3, total, kept_peak_frozen(4 if frozen else 0))
    strategy = TieredStrategy(policy={**PARAMETERS_ONLY, "placement": "nvme"}, gpu_memory=gpu_memory, host_memory=int(4.2 * total),
                              nvme_path=tmp_path / "nvme", nvme_memory="64MiB")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=_model(frozen), extra_callbacks=(checked,))
    assert checked.race_checked and checked.nvme_units > 0
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


@pytest.mark.slow
def test_host_units_are_updated_at_home_only_after_the_copies_out_of_them(tmp_path, monkeypatch):
    """GO-MemFerry's direct gradients, written at home by compute: the update at home waits for
    the compute on the host (``compute_done``), and with it for every copy out of the home that
    compute waited for; the emulated tier skipped that wait, which the race check named at the
    update. Every copy lands late: training is plain Lightning's, bit for bit."""
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=gpt2_4l)
    monkeypatch.setenv(RACE_CHECK_ENV, "4")
    total, checked = param_bytes(gpt2_4l), Checked()
    strategy = TieredStrategy(policy="go_memferry", gpu_memory=beside_kept(0.5, total), host_memory=int(6 * total))
    losses, weights, trainer = train(strategy, tmp_path / "tiered", epochs=1, make_model=gpt2_4l, extra_callbacks=(checked,))
    assert checked.race_checked and trainer.strategy.metrics()["units/direct_gradients"] > 0
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_a_copy_s_gpu_tier_side_keeps_its_addresses_until_the_host_waited_for_it():
    """CUDA's caching allocator reuses no memory a copy stream still uses (``record_stream``). The
    books held only the addresses: a gradient freed once its copy home had landed, before the
    host waited for it, gave its memory to the next host buffer, an NVMe read's staging, which
    the check then took for the gradient's copy still reading it (a CopyRaceError in
    ``test_swap_host_beyond_host_memory_goes_to_nvme_or_stays``, where the allocator reused it)."""
    with EmulatedDevice(1 << 20, race_check=RaceCheck(max_delay_s=0.001, seed=4)) as device:
        gradient, home = torch.ones(8192, dtype=torch.uint8), torch.empty(8192, dtype=torch.uint8)
        storage = StorageWeakRef(gradient.untyped_storage())
        event = device.copy_to_host(home, gradient)
        del gradient
        time.sleep(0.05)  # landed: the link has let go of it
        gc.collect()
        assert not storage.expired(), "the gradient's memory was free to reuse while its copy was in the books"
        device.host_wait(event)
        gc.collect()
        assert storage.expired()
        assert torch.equal(home, torch.ones(8192, dtype=torch.uint8))
