"""What the race check costs a run of tests: a pytest plugin that counts the copies the race check
kept books for, the delays it drew for them (what landing each copy late by sleeping would add),
and the seconds the links spent holding copies back (a wait lands a copy at once, so most of them
overlap compute or are cut short). Figures for docs/benchmarks.md, "The suite under the race check":

    PYTHONPATH=$PWD python -m pytest -q -p tools.race_check_cost tests/test_offload.py
"""

from __future__ import annotations

import threading
import time
from typing import Any

from offload_strategy.hardware import device

_totals = {"copies": 0, "drawn": 0.0, "held": 0.0}
_lock = threading.Lock()
_issued = device.RaceCheck.issued
_wait_for = threading.Condition.wait_for


def _counted_issued(self: device.RaceCheck, *args: Any) -> float:
    delay = _issued(self, *args)
    with _lock:
        _totals["copies"] += 1
        _totals["drawn"] += delay
    return delay


def _timed_wait_for(self: threading.Condition, predicate: Any, timeout: Any = None) -> Any:
    start = time.perf_counter()
    try:
        return _wait_for(self, predicate, timeout)
    finally:
        if threading.current_thread().name in ("offload-h2d", "offload-d2h"):  # a link holding a copy back
            with _lock:
                _totals["held"] += time.perf_counter() - start


device.RaceCheck.issued = _counted_issued  # type: ignore[method-assign]
threading.Condition.wait_for = _timed_wait_for  # type: ignore[method-assign]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(
        f"race check: {_totals['copies']} copies, {_totals['drawn']:.2f} s of delays drawn, links held copies back "
        f"{_totals['held']:.2f} s (this process; not the processes tests start)"
    )
