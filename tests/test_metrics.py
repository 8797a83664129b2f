import pytest

from offload_strategy.runtime.metrics import HIT, LATE_HIT, MISS, QUANTILE_WINDOW, RequestStats


def test_rates_thresholds_and_quantiles():
    stats = RequestStats()
    # 6 hits (no wait), 2 late hits of 0.02 ms and 0.05 ms, 2 misses of 1 ms
    for _ in range(6):
        stats.add(HIT, 0.0)
    stats.add(LATE_HIT, 0.02e-3)
    stats.add(LATE_HIT, 0.05e-3)
    stats.add(MISS, 1e-3)
    stats.add(MISS, 1e-3)
    report = stats.report()
    assert report["requests"] == 10 and report["hit_rate"] == 0.6 and report["late_hit_rate"] == 0.2 and report["miss_rate"] == 0.2
    assert report["wait_under_0.01ms_fraction"] == 0.6 and report["wait_under_0.03ms_fraction"] == 0.7 and report["wait_under_0.1ms_fraction"] == 0.8
    assert report["wait_p50_ms"] == 0.0 and report["wait_p99_ms"] == pytest.approx(1.0)
    assert report["wait_total_ms"] == pytest.approx(2.07)
    stats.reset()
    assert stats.report() == {"requests": 0, "out_of_order": 0, "nvme_reads_avoided": 0}


def test_memory_stays_bounded_when_nobody_reads_the_metrics():
    stats = RequestStats()
    for i in range(QUANTILE_WINDOW + 1000):
        stats.add(HIT, 0.0)
    assert len(stats.recent) == QUANTILE_WINDOW
    assert stats.report()["requests"] == QUANTILE_WINDOW + 1000


def test_optimizer_state_bytes_count_the_units_kept_in_the_gpu_tier(tmp_path):
    """SGD with momentum keeps one buffer per parameter: the GPU tier's optimizer states are the
    persistent units' parameter bytes exactly (they were reported as 0)."""
    import lightning as L
    import torch

    from offload_strategy import TieredStrategy
    from tests.test_recipes import Net, fit

    class Momentum(Net):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    seen = {}

    class Homes(L.Callback):
        def on_train_end(self, trainer, pl_module):
            engine = trainer.strategy.engine
            seen["gpu"] = sum(p.numel() * p.element_size() for s in engine.states if s.home == "gpu" for p in s.unit.params)
            seen["offloaded"] = sum(s.home != "gpu" for s in engine.states)

    kept_peak = 239_524  # the kept layout's peak in the GPU tier at tiny_data's batch, measured in the first training step
    # 200 KiB for the parameters once they are placed again beside it: some units there, some offloaded
    strategy = TieredStrategy(policy={"placement": "fill", "activations": "keep"}, gpu_memory=200 * 1024 + kept_peak, host_memory="1GiB")
    fit(strategy, tmp_path, Momentum, steps=3, callbacks=(Homes(),))
    metrics = strategy.metrics()
    assert seen["gpu"] > 0 and seen["offloaded"] > 0, seen
    assert metrics["optimizer/gpu_state_bytes"] == seen["gpu"]
    assert metrics["optimizer/host_state_bytes"] > 0
