"""The host's share of a gradient's way home runs off autograd's thread, which only queues it (on a
GPU the host waiting for a copy waits for everything queued before it, so a wait there drains the
GPU once per parameter): a later micro-batch's gradient is added at home on the update worker, a
16-bit one widened there, a ``tiered_ddp`` reduction launched from its own thread once its
gradients have landed, and a ``swap_nvme`` block's tensor written once its copy has landed with
no wait in the pack hook. Every run is under the race check (copies land late; a host access
before its wait raises) and trains as plain Lightning does, bit for bit."""

from __future__ import annotations

import contextlib
import threading

import lightning as L
import pytest
import torch.distributed as dist

from offload_strategy import TieredStrategy
from offload_strategy.hardware.device import RACE_CHECK_ENV, Device, Event
from offload_strategy.runtime.activations.swap import ActivationSwap
from offload_strategy.runtime.grads.path import GradientPath
from offload_strategy.runtime.updates.worker import UpdateWorker
from tests.ddp_job import kept_peak
from tests.ddp_launch import launch, load
from tests.helpers import PARAMETERS_ONLY, assert_same_weights, train
from tests.test_activations import Swapped, gpt2
from tests.test_offload import beside_kept, gpt2_4l, param_bytes
from tests.test_precision import FP32AccumulatingLM


class CopyWaits:
    """The threads that waited on the host for copies issued inside ``issuer`` (a method of
    ``owner``), by name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: type, issuer: str) -> None:
        self.threads: list[str] = []
        self._issued: dict[int, Event] = {}
        inside = threading.local()
        issue, copy_to_host, wait = getattr(owner, issuer), Device.copy_to_host, Event.wait

        def issuing(*args, **kwargs):
            inside.on = True
            try:
                return issue(*args, **kwargs)
            finally:
                inside.on = False

        def copying(device, dst, src):
            event = copy_to_host(device, dst, src)
            if getattr(inside, "on", False):
                self._issued[id(event)] = event
            return event

        def waiting(event):
            if self._issued.get(id(event)) is event:
                self.threads.append(threading.current_thread().name)
            return wait(event)

        monkeypatch.setattr(owner, issuer, issuing)
        monkeypatch.setattr(Device, "copy_to_host", copying)
        monkeypatch.setattr(Event, "wait", waiting)


# Gradients copied home as on CUDA (``gradient_reserve=1``, CUDA's default; the emulated tier's
# default writes them at home in place). No prefetch: a prefetch past the last micro-batch into
# the next forward races with the updates at home, which tests/test_race_check.py covers on its own.
COPIED_HOME = {"gradient_reserve": 1.0, "prefetch": False}


def _host_strategy() -> TieredStrategy:
    # 0.3 of the parameters in the GPU tier beside the kept layout's peak, the rest at home
    return TieredStrategy(policy={**PARAMETERS_ONLY, **COPIED_HOME}, gpu_memory=beside_kept(0.3, param_bytes(gpt2_4l)), host_memory="1GiB")


def _nvme_strategy(path) -> TieredStrategy:
    """Under ``bf16-true``: 0.3 of the parameters beside the kept layout's 16-bit peak."""
    total = param_bytes(gpt2_4l)
    return TieredStrategy(policy={**PARAMETERS_ONLY, **COPIED_HOME}, gpu_memory=beside_kept(0.3, total, kept_peak(4, "bf16-true")),
                          host_memory=int(4.2 * total), nvme_path=path, nvme_memory="64MiB")


class Pieces(L.Callback):
    """The size of the staging's pieces, and how many it made beyond its few."""

    def __init__(self) -> None:
        self.piece_bytes, self.extra = 0, 0

    def on_train_batch_end(self, trainer, *args) -> None:
        engine = trainer.strategy.engine
        if engine is None and trainer.global_step <= 1:
            return  # everything fits the whole tier while the first step measures the kept layout: offloading starts after it
        staging = engine.gradients.staging
        self.piece_bytes, self.extra = staging.piece_bytes, staging.extra


def _assert_added_on_the_worker(tmp_path, monkeypatch, accumulate: int, pieces: "Pieces") -> None:
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=gpt2_4l, accumulate_grad_batches=accumulate)
    monkeypatch.setenv(RACE_CHECK_ENV, str(accumulate))
    waits = CopyWaits(monkeypatch, GradientPath, "receive")
    losses, weights, trainer = train(_host_strategy(), tmp_path / "tiered", epochs=1, make_model=gpt2_4l, accumulate_grad_batches=accumulate,
                                     extra_callbacks=(pieces,))
    assert trainer.strategy.metrics()["units/host"] > 0
    assert waits.threads and set(waits.threads) == {"offload-update"}, sorted(set(waits.threads))
    assert pieces.extra == 0
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_later_micro_batches_are_added_at_home_on_the_update_worker(tmp_path, monkeypatch):
    """Autograd's thread waited for the gradient's last copy home, then copied the new one into
    pageable memory and added it there, for every offloaded parameter of every later micro-batch."""
    _assert_added_on_the_worker(tmp_path, monkeypatch, 2, Pieces())


@pytest.mark.slow
def test_a_later_micro_batch_goes_home_in_pieces_no_larger_than_the_staging(tmp_path, monkeypatch):
    """Four micro-batches a step; a gradient larger than a staging piece (the embedding: 32 KiB
    against 4 KiB) is copied and added a piece at a time, through the few pieces there are,
    autograd's thread waiting for the worker to give one back."""
    monkeypatch.setattr("offload_strategy.runtime.grads.staging.PIECE_BYTES", 4096)
    pieces = Pieces()
    _assert_added_on_the_worker(tmp_path, monkeypatch, 4, pieces)
    assert pieces.piece_bytes == 4096


@pytest.mark.slow
def test_later_micro_batches_of_nvme_units_and_16_bit_gradients_settle_on_the_update_worker(tmp_path, monkeypatch):
    """Units in every tier under ``bf16-true``: a 16-bit gradient lands beside its fp32 master's
    and is widened (or added) into it on the worker; NVMe units' gradients wait in their buffers
    and on NVMe between micro-batches as before. The reference is plain Lightning updating fp32
    masters by hand (``tests/test_precision.py``)."""
    kwargs = dict(precision="bf16-true", accumulate_grad_batches=3)
    expected_losses, expected_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=FP32AccumulatingLM, **kwargs)
    monkeypatch.setenv(RACE_CHECK_ENV, "7")
    waits = CopyWaits(monkeypatch, GradientPath, "receive")
    losses, weights, trainer = train(_nvme_strategy(tmp_path / "nvme"), tmp_path / "tiered", epochs=2, make_model=gpt2_4l, **kwargs)
    metrics = trainer.strategy.metrics()
    assert metrics["units/host"] > 0 and metrics["units/nvme"] > 0
    assert waits.threads and set(waits.threads) == {"offload-update"}, sorted(set(waits.threads))
    assert losses == expected_losses
    assert_same_weights(expected_weights, weights)


@pytest.mark.slow
def test_swap_nvme_writes_each_tensor_once_its_copy_has_landed_without_a_wait_in_the_pack_hook(tmp_path, monkeypatch):
    """Every block's activations to NVMe, two micro-batches a step, gradients copied home: the
    pack hook waited for each saved tensor's copy out of the GPU tier before queueing its write;
    the store's threads wait for it now, and backward's unpack waits for the write."""
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=gpt2, accumulate_grad_batches=2)
    monkeypatch.setenv(RACE_CHECK_ENV, "13")
    waits, seen = CopyWaits(monkeypatch, ActivationSwap, "_pack"), Swapped()
    strategy = TieredStrategy(policy={"name": "auto", "activations": "swap_nvme", **COPIED_HOME}, nvme_path=tmp_path / "nvme")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=gpt2, accumulate_grad_batches=2, extra_callbacks=(seen,))
    assert seen.metrics[-1]["activations/swapped_nvme_bytes"] > 0
    assert waits.threads and all(name.startswith("nvme") for name in waits.threads), sorted(set(waits.threads))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_tiered_ddp_waits_for_gradients_and_launches_reductions_off_autograds_thread(tmp_path, monkeypatch):
    """Two ranks, host and NVMe units, gradients copied home: each unit's reduction waited on the
    host for its gradients' copies and launched, on autograd's thread; a thread of its own does
    both now, in the canonical order. Losses and weights are DDP's, bit for bit."""
    args = ("--accumulate", "2", "--epochs", "1")
    plain = launch(tmp_path / "ddp", "--strategy", "ddp", *args)
    monkeypatch.setenv(RACE_CHECK_ENV, "17")
    tiered = launch(tmp_path / "tiered_ddp", "--strategy", "tiered_ddp", "--copied-home", "--record-threads", "--nvme", str(tmp_path / "nvme"), *args)
    for rank in (0, 1):
        threads = tiered[rank]["threads"]
        assert threads["launches"] and set(threads["launches"]) == {"offload-reduce"}, sorted(set(threads["launches"]))
        assert threads["copy_waits"] and "MainThread" not in threads["copy_waits"], sorted(set(threads["copy_waits"]))
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
    assert_same_weights(load(tmp_path / "ddp" / "weights.pt"), load(tmp_path / "tiered_ddp" / "weights.pt"))


def test_a_task_the_worker_skipped_after_a_failure_raises_that_failure_to_whoever_waits():
    """Autograd's thread may wait for an add the worker skipped (an update failed before it): it
    gets the failure, not a wait for ever; a task waiting for one queued behind it is refused."""
    worker = UpdateWorker(name="test-worker")
    try:
        failing = worker.submit(lambda: 1 / 0)
        skipped = worker.submit(lambda: None)
        with pytest.raises(ZeroDivisionError):
            skipped.wait()
        with pytest.raises(ZeroDivisionError):
            failing.wait()
        with pytest.raises(ZeroDivisionError):
            worker.drain()
        later: list = []
        first = worker.submit(lambda: later[0].wait())
        later.append(worker.submit(lambda: None))
        with pytest.raises(RuntimeError, match="queued after it"):
            first.wait()
    finally:
        with contextlib.suppress(RuntimeError):
            worker.drain()
        worker.close()
