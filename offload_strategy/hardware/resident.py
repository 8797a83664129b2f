"""This process's resident memory on Linux, from ``/proc/self``: now, at its peak, and per phase of
a run, the peak starting again between phases (``tools/largest.py`` and the tests that hold
host memory to its bound measure with it)."""

from __future__ import annotations

import threading
import time


def proc_status(field: str) -> int:
    """A size field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; 0 where there is none."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    return proc_status("VmHWM")


def reset_peak() -> None:
    """The high-water mark starts again from the current resident set (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class Phases:
    """Peak resident set of each phase of a run: the kernel's high-water mark (``VmHWM``, reset
    between phases), and the anonymous resident set (``RssAnon``: the heap, tensors, pinned and
    mapped anonymous memory; not the libraries' file pages) sampled by a thread every
    ``interval`` seconds, whose peak per phase is held against the budget."""

    def __init__(self, interval: float = 0.005) -> None:
        self.peaks: dict[str, int] = {}
        self.anonymous: dict[str, int] = {}
        self.start = time.perf_counter()
        self.phase = "before fit"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._sample, args=(interval,), name="rss-sampler", daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._stop.is_set():
            self.note()
            self._stop.wait(interval)

    def note(self) -> None:
        rss = proc_status("RssAnon")
        with self._lock:
            self.anonymous[self.phase] = max(self.anonymous.get(self.phase, 0), rss)

    def begin(self, name: str) -> None:
        """The phase ``name`` starts now (the anonymous peak of the one before is closed)."""
        self.note()
        with self._lock:
            self.phase = name
        self.note()

    def end(self, name: str) -> None:
        self.peaks[name] = peak_rss()
        reset_peak()

    def stop(self) -> None:
        self.note()
        self._stop.set()
        self._thread.join()
