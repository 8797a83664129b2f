"""Counters of the runtime: how often a unit was resident when asked for, and how long we waited."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

HIT, LATE_HIT, MISS = "hit", "late_hit", "miss"
WAIT_THRESHOLDS_MS = (0.01, 0.03, 0.1)
# Quantiles are taken over at most this many of the latest waits, so that a run nobody reads the
# metrics of does not keep one number per request forever.
QUANTILE_WINDOW = 65536


@dataclass
class RequestStats:
    """Requests for units since the last report; waits in seconds (a hit waits 0)."""

    counts: dict[str, int] = field(default_factory=lambda: {HIT: 0, LATE_HIT: 0, MISS: 0})
    under: dict[float, int] = field(default_factory=lambda: dict.fromkeys(WAIT_THRESHOLDS_MS, 0))
    wait_total: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=QUANTILE_WINDOW))
    out_of_order: int = 0
    nvme_reads_avoided: int = 0  # NVMe units fetched from the copy kept in host memory

    def add(self, kind: str, wait: float) -> None:
        self.counts[kind] += 1
        self.wait_total += wait
        self.recent.append(wait)
        wait_ms = wait * 1e3
        for threshold in WAIT_THRESHOLDS_MS:
            if wait_ms < threshold:
                self.under[threshold] += 1

    def report(self) -> dict[str, float]:
        total = sum(self.counts.values())
        out: dict[str, float] = {"requests": total, "out_of_order": int(self.out_of_order), "nvme_reads_avoided": int(self.nvme_reads_avoided)}
        if total == 0:
            return out
        out["hit_rate"] = self.counts[HIT] / total
        out["late_hit_rate"] = self.counts[LATE_HIT] / total
        out["miss_rate"] = self.counts[MISS] / total
        for threshold in WAIT_THRESHOLDS_MS:
            out[f"wait_under_{threshold}ms_fraction"] = self.under[threshold] / total
        recent_ms = torch.tensor(list(self.recent), dtype=torch.float64) * 1e3
        out["wait_p50_ms"] = float(recent_ms.quantile(0.5))
        out["wait_p99_ms"] = float(recent_ms.quantile(0.99))
        out["wait_total_ms"] = self.wait_total * 1e3
        return out

    def reset(self) -> None:
        self.counts = {HIT: 0, LATE_HIT: 0, MISS: 0}
        self.under = dict.fromkeys(WAIT_THRESHOLDS_MS, 0)
        self.wait_total = 0.0
        self.recent.clear()
        self.out_of_order = 0
        self.nvme_reads_avoided = 0
