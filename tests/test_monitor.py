import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from offload_strategy import OffloadMonitor, TieredStrategy
from offload_strategy.demos import MetricsRecorder


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
    assert [s for s, _ in recorder.history["tier/memory/process_peak_rss_bytes"]] == [5, 10, 10]


def test_ignores_strategies_without_metrics(tmp_path):
    monitor = OffloadMonitor()
    recorder = fit("auto", tmp_path, monitor)
    assert not any(k.startswith("offload/") for k in recorder.history)
    assert monitor.last == {}


def test_rejects_bad_interval():
    with pytest.raises(ValueError, match="every_n_steps=0"):
        OffloadMonitor(every_n_steps=0)


class TwoLayers(L.LightningModule):
    """Two units of (8 x 8 + 8) fp32 parameters: a unit packs each parameter at 64-byte alignment,
    so 256 bytes of weight and 32 of bias (padded to 64) travel as 320 bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        return self.second(torch.relu(self.first(batch[0]))).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 8)), batch_size=4)


def test_metric_values_on_a_hand_worked_run(tmp_path):
    """zero_offload (every parameter in the GPU tier through the step, gradients copied home, SGD
    momentum at home): each step brings both units in, 2 x 320 bytes, and copies their gradients
    out parameter by parameter, 2 x 288 bytes; the states are one momentum buffer per parameter,
    2 x 288 bytes in host memory."""
    seen = []

    class Last(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(trainer.strategy.metrics())

    strategy = TieredStrategy(policy="zero_offload", gpu_memory="1MiB", host_memory="64MiB")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False, callbacks=[Last()],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(TwoLayers())
    last = seen[-1]
    assert last["link/h2d_bytes_total"] == 3 * 640 and last["link/d2h_bytes_total"] == 3 * 576
    assert [m["link/h2d_bytes_total"] for m in seen] == [640, 2 * 640, 3 * 640]  # totals since the start
    assert last["units/host"] == 2 and last["units/gpu"] == 0 and last["units/nvme"] == 0
    assert last["optimizer/host_state_bytes"] == 576 and last["optimizer/gpu_state_bytes"] == 0 and last["optimizer/nvme_state_bytes"] == 0
    # the GPU tier carves a 512-byte-aligned buffer per unit out of the 1 MiB budget
    assert last["tier/gpu_reserved_bytes"] == 2 * 512 and last["budget/gpu_bytes"] == 2**20
    # each interval is one step here: the rates add up to 1, the fractions are fractions
    assert last["cache/hit_rate"] + last["cache/late_hit_rate"] + last["cache/miss_rate"] == pytest.approx(1.0)
    assert 0.0 <= last["cache/wait_under_0.01ms_fraction"] <= last["cache/wait_under_0.1ms_fraction"] <= 1.0
    assert last["memory/process_peak_rss_bytes"] > last["tier/host_bytes"] > 0


def test_progress_bar_shows_hit_rate_gpu_tier_and_exposed_update_without_starting_an_interval(tmp_path):
    recorder = MetricsRecorder()
    monitor = OffloadMonitor(prog_bar=True)
    strategy = TieredStrategy(policy="zero_offload", gpu_memory="1MiB", host_memory="64MiB")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, log_every_n_steps=2, logger=[recorder], callbacks=[monitor],
                        enable_progress_bar=True, enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(TwoLayers())
    bar = trainer.progress_bar_metrics
    assert set(bar) >= {"offload_hit", "gpu_tier_MiB", "update_exposed_ms"}, bar
    assert 0.0 <= bar["offload_hit"] <= 1.0 and bar["update_exposed_ms"] > 0
    assert bar["gpu_tier_MiB"] == pytest.approx(monitor.last["offload/tier/gpu_bytes"] / 2**20)
    # the logged requests cover the two steps of each interval, not the one step since the bar last looked
    requests = [value for _, value in recorder.history["offload/cache/requests"]]
    assert requests[0] == requests[1] > 0 and requests[0] % 2 == 0
    assert not any(key.startswith("offload_") for key in recorder.history)  # the bar's names stay out of the loggers
