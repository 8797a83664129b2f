"""The plan's predicted step beside the steps measured under it, so that every prediction the
strategy prints comes with the step model's error on this run (docs/guide.md, "What the strategy prints and decides")."""

from __future__ import annotations

import statistics
import time
from typing import Optional

REPORT_AFTER = 10  # steps measured under a plan before its error is reported
KEPT = 50  # the most recent steps the median is taken over


class PredictionCheck:
    """Wall time from a step's first forward to the end of its optimizer step, for the steps run
    under the last plan (the first one after a plan is put in place is left out: it touches new
    buffers), and the plan's prediction for them."""

    def __init__(self) -> None:
        self.predicted_seconds: Optional[float] = None
        self.source = ""
        self.measured: list[float] = []
        self._started: Optional[float] = None
        self._skip = 0
        self._reported = False

    def planned(self, seconds: float, source: str) -> None:
        """A plan is put in place with this prediction (``source``: which model made it)."""
        self.predicted_seconds, self.source = seconds, source
        self.measured.clear()
        self._skip, self._reported = 1, False

    def step_begins(self) -> None:
        if self._started is None:  # accumulated micro-batches are one step
            self._started = time.perf_counter()

    def step_ends(self) -> Optional[str]:
        """The optimizer step ended; a line to report once enough steps were measured."""
        ended, started, self._started = time.perf_counter(), self._started, None
        if started is None or self.predicted_seconds is None:
            return None
        if self._skip:
            self._skip -= 1
            return None
        self.measured.append(ended - started)
        del self.measured[:-KEPT]
        if len(self.measured) < REPORT_AFTER or self._reported:
            return None
        self._reported = True
        measured, error = self.measured_seconds(), self.error()
        assert measured is not None and error is not None
        return (f"tiered: the {self.source} predicted {self.predicted_seconds * 1e3:.1f} ms per step; the median of "
                f"{len(self.measured)} steps under it is {measured * 1e3:.1f} ms ({error:+.0%}).")

    def measured_seconds(self) -> Optional[float]:
        return statistics.median(self.measured) if self.measured else None

    def error(self) -> Optional[float]:
        """Measured over predicted, less one (+0.25: the steps took 25% longer than predicted)."""
        measured = self.measured_seconds()
        if measured is None or not self.predicted_seconds:
            return None
        return measured / self.predicted_seconds - 1.0

    def metrics(self) -> dict[str, float]:
        measured, error = self.measured_seconds(), self.error()
        if self.predicted_seconds is None:
            return {}
        out = {"plan/predicted_step_ms": 1e3 * self.predicted_seconds}
        if measured is not None and error is not None:
            out["plan/measured_step_ms"] = 1e3 * measured
            out["plan/prediction_error"] = error
        return out
