import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from experiments.summary import MetricsRecorder
from offload_strategy import OffloadMonitor, TieredStrategy


class CountingStrategy(TieredStrategy):
    """Reports how often it was asked, to check the monitor's cadence."""

    calls = 0

    def metrics(self):
        CountingStrategy.calls += 1
        return {**super().metrics(), "cache/hit_rate": 0.75}


def fit(strategy, tmp_path, monitor, steps=10, every=2):
    recorder = MetricsRecorder()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=every, logger=[recorder],
                        callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    return recorder


def test_logs_strategy_metrics_every_logged_step(tmp_path):
    CountingStrategy.calls = 0
    monitor = OffloadMonitor()
    recorder = fit(CountingStrategy(), tmp_path, monitor, steps=10, every=2)
    steps = [step for step, _ in recorder.history["offload/cache/hit_rate"]]
    assert steps == [2, 4, 6, 8, 10, 10]  # every logged step, then once at the end of training
    assert CountingStrategy.calls == 6
    assert recorder.last("offload/cache/hit_rate") == 0.75
    assert recorder.last("offload/budget/host_bytes") > 0
    assert monitor.last["offload/cache/hit_rate"] == 0.75


def test_own_interval_and_prefix(tmp_path):
    recorder = fit(TieredStrategy(), tmp_path, OffloadMonitor(prefix="tier/", every_n_steps=5), steps=10, every=1)
    assert [s for s, _ in recorder.history["tier/memory/host_peak_bytes"]] == [5, 10, 10]


def test_ignores_strategies_without_metrics(tmp_path):
    monitor = OffloadMonitor()
    recorder = fit("auto", tmp_path, monitor)
    assert not any(k.startswith("offload/") for k in recorder.history)
    assert monitor.last == {}


def test_rejects_bad_interval():
    with pytest.raises(ValueError, match="every_n_steps=0"):
        OffloadMonitor(every_n_steps=0)
