"""What a run reports at the end: a table on stdout and ``metrics.json``."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

from offload_strategy.config import format_bytes
from offload_strategy.demos import MetricsRecorder
from offload_strategy.hardware import process_peak_rss


def build_summary(
    recorder: MetricsRecorder,
    *,
    model_name: str,
    num_parameters: int,
    strategy: str,
    steps: int,
    wall_seconds: float,
    peak_flops: Optional[float],
    peak_gpu_bytes: Optional[int],
    offload: Optional[dict[str, float]] = None,
) -> dict[str, Any]:
    """Flat, JSON-serialisable run summary from what was logged; ``offload``: the tiered
    strategy's figures after ``fit``, for what no logger recorded (``fast_dev_run`` logs nothing).

    Peak memory is measured the same way whatever the strategy, so that baselines compare.
    """
    batches_per_sec = recorder.last("train/device/batches_per_sec")
    flops_per_sec = recorder.last("train/device/flops_per_sec")
    mfu = recorder.last("train/device/mfu")
    if mfu is None and flops_per_sec is not None and peak_flops:
        mfu = flops_per_sec / peak_flops
    summary: dict[str, Any] = {
        "model": model_name,
        "parameters": num_parameters,
        "strategy": strategy,
        "steps": steps,
        "wall_seconds": wall_seconds,
        "tokens_per_sec": recorder.last("train/device/items_per_sec"),
        "samples_per_sec": recorder.last("train/device/samples_per_sec"),
        "step_time_ms": 1000.0 / batches_per_sec if batches_per_sec else None,
        "flops_per_sec": flops_per_sec,
        "mfu": mfu,
        "train_loss_first": recorder.first("train/loss"),
        "train_loss_last": recorder.last("train/loss"),
        "val_loss": recorder.last("val/loss"),
        "peak_gpu_bytes": peak_gpu_bytes,
        "peak_host_bytes": process_peak_rss(),
    }
    for key, value in sorted((offload or {}).items()):
        summary[f"offload/{key}"] = value
    for key in sorted(recorder.history):
        if key.startswith("offload/"):
            summary[key] = recorder.last(key)
    return summary


def _fmt(key: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if key.endswith("_bytes"):
        return format_bytes(value)
    if key == "mfu":
        return f"{value:.1%}"
    if key == "parameters":
        return f"{value / 1e6:,.2f} M"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _tiers(summary: dict[str, Any]) -> tuple[str, str]:
    """Units per tier and memory per tier, from the tiered strategy's figures (absent for a plain run)."""
    units = ", ".join(f"{tier} {int(summary[f'offload/units/{tier}'])}" for tier in ("gpu", "host", "nvme")
                      if summary.get(f"offload/units/{tier}") is not None)
    memory = [f"{name} {_fmt('_bytes', summary.get(key))}" for name, key in
              (("gpu tier peak", "offload/tier/gpu_peak_bytes"), ("host peak", "offload/tier/host_peak_bytes"),
               ("nvme", "offload/tier/nvme_bytes"), ("process peak", "peak_host_bytes")) if summary.get(key) is not None]
    return units or "n/a (not the tiered strategy)", ", ".join(memory)


def format_short_summary(summary: dict[str, Any], metrics_path: Optional[Path] = None) -> str:
    """About ten lines a user reads at the end of a run; every figure is in ``metrics.json`` and the logger."""
    units, memory = _tiers(summary)
    step = summary.get("step_time_ms")
    rows = [
        ("run", f"{summary['model']} ({_fmt('parameters', summary['parameters'])}), preset {summary.get('preset', 'n/a')}, "
                f"{summary['steps']} steps in {summary['wall_seconds']:.0f} s"),
        ("throughput", f"{_fmt('tokens_per_sec', summary.get('tokens_per_sec'))} tokens/s, "
                       f"{_fmt('step_time_ms', step)} ms per step"),
        ("loss", f"train {_fmt('loss', summary.get('train_loss_first'))} -> {_fmt('loss', summary.get('train_loss_last'))}, "
                 f"val {_fmt('loss', summary.get('val_loss'))}"),
        ("units per tier", units),
        ("memory", memory),
        ("cache hit rate", _fmt("mfu", summary.get("offload/cache/hit_rate"))),
        ("checkpoint", str(summary.get("checkpoint") or "none written")),
    ]
    if metrics_path is not None:
        rows.append(("all figures", str(metrics_path)))
    width = max(len(name) for name, _ in rows)
    return "\n".join(["", "Run summary", *(f"  {name:<{width}}  {value}" for name, value in rows)])


def format_summary(summary: dict[str, Any]) -> str:
    width = max(len(k) for k in summary)
    lines = ["", "Run summary", "-" * (width + 24)]
    lines += [f"{key:<{width}}  {_fmt(key, value)}" for key, value in summary.items()]
    return "\n".join(lines)


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as JSON so that a crash never leaves a half-written file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str))
    os.replace(tmp, path)
