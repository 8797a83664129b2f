"""Counters of the runtime: how often a unit was resident when asked for, and how long we waited."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

HIT, LATE_HIT, MISS = "hit", "late_hit", "miss"
WAIT_THRESHOLDS_MS = (0.01, 0.03, 0.1)


@dataclass
class RequestStats:
    """Requests for units since the last report; waits in seconds (a hit waits 0)."""

    counts: dict[str, int] = field(default_factory=lambda: {HIT: 0, LATE_HIT: 0, MISS: 0})
    waits: list[float] = field(default_factory=list)
    out_of_order: int = 0
    nvme_reads_avoided: int = 0  # NVMe units fetched from the copy kept in host memory

    def add(self, kind: str, wait: float) -> None:
        self.counts[kind] += 1
        self.waits.append(wait)

    def report(self) -> dict[str, float]:
        total = sum(self.counts.values())
        out: dict[str, float] = {"requests": float(total), "out_of_order": float(self.out_of_order), "nvme_reads_avoided": float(self.nvme_reads_avoided)}
        if total == 0:
            return out
        out["hit_rate"] = self.counts[HIT] / total
        out["late_hit_rate"] = self.counts[LATE_HIT] / total
        out["miss_rate"] = self.counts[MISS] / total
        waits_ms = torch.tensor(self.waits, dtype=torch.float64) * 1e3
        for threshold in WAIT_THRESHOLDS_MS:
            out[f"wait_under_{threshold}ms"] = float((waits_ms < threshold).double().mean())
        out["wait_p50_ms"] = float(waits_ms.quantile(0.5))
        out["wait_p99_ms"] = float(waits_ms.quantile(0.99))
        out["wait_total_ms"] = float(waits_ms.sum())
        return out

    def reset(self) -> None:
        self.counts = {HIT: 0, LATE_HIT: 0, MISS: 0}
        self.waits = []
        self.out_of_order = 0
        self.nvme_reads_avoided = 0
