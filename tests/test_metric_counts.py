"""Counts in ``metrics()`` are integers: a log or a summary shows ``9 units``, never ``9.0``."""

from offload_strategy import TieredStrategy
from offload_strategy.runtime.metrics import HIT, RequestStats
from tests.test_recipes import Net, fit

COUNTS = ("units/gpu", "units/host", "units/nvme", "units/direct_gradients", "gradients/buffers_most_held",
          "gradients/buffers_beyond_plan_total", "cache/requests", "cache/out_of_order", "cache/nvme_reads_avoided")


def test_request_counts_are_ints():
    stats = RequestStats()
    stats.add(HIT, 0.0)
    report = stats.report()
    assert type(report["requests"]) is int and report["requests"] == 1
    assert type(report["hit_rate"]) is float


def test_strategy_metrics_give_counts_as_ints(tmp_path):
    strategy = TieredStrategy(policy={"placement": "fill", "activations": "keep"}, gpu_memory="434KiB", host_memory="1GiB")  # 234 of it the kept blocks'
    fit(strategy, tmp_path, Net, steps=2)
    metrics = strategy.metrics()
    for key in COUNTS:
        assert type(metrics[key]) is int, (key, metrics[key])
    assert metrics["units/host"] > 0 and f"{metrics['units/host']} units" == f"{int(metrics['units/host'])} units"
    assert all(type(v) is int for k, v in metrics.items() if k.startswith("activations/blocks_"))
