"""The GPU's timeline under ``torch.profiler``, beside what the engine measures: a 150M-parameter
GPT-2 (``transformers`` config, random weights) with every unit at home in host memory and
streamed through the GPU tier, two steps profiled after warm-up ones.

    python tools/gpu_timeline.py                         # 12 layers x 1024, batch 8 x 1024, bf16-mixed

Printed, for the profiled steps:

- each stream's busy time (the union of its kernels and copies), which is compute (the stream
  with the most kernel time) and which copy (the others that copy); the time compute and copies
  overlapped; the time compute stood idle while a copy ran (what it may have waited for copies:
  an upper bound);
- each unit's compute time as the engine profiled it (``engine.timer.last_timing``: marks on the
  compute stream, the waits for units left out; what the placement search, the activation layout
  and the step model are priced from) beside the profiler's: the kernels launched while the
  engine timed that unit (its intervals are marked in the trace as the engine opens them), forward
  and backward, with the ratio; the issue's target is within 10%.

The last line sums it up. Exits 0 once measured, whatever the ratio.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.gpu_parts import add_device_argument, exit_without_cuda

if __name__ == "__main__":
    exit_without_cuda("timeline", sys.argv[1:])  # before the imports below: one line and exit 2 without a GPU

import argparse
import bisect
import json
import os
import statistics
import tempfile
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from offload_strategy import TieredStrategy
from offload_strategy.demos import gpt2_config
from offload_strategy.planning.profile import StepProfile
from tools.common import StepTimer, add_run_arguments, fit

MARK = "timer: "  # the trace's marks of the engine's intervals: "timer: forward 3", "timer: outside backward", ...
FORWARD, BACKWARD, OUTSIDE_FORWARD, OUTSIDE_BACKWARD, END = "forward", "backward", "outside forward", "outside backward", "end"
Span = tuple[float, float]  # microseconds, as the trace gives them


# -- marks of the engine's intervals in the trace ------------------------------------------------------


def _mark(name: str) -> None:
    with record_function(MARK + name):  # an empty range: its start is the mark
        pass


class TimerMarks:
    """Wraps an engine's step timer so that each interval it opens leaves a mark in the profile
    (the calls come from the module hooks, the saved-tensor hooks and the engine's step)."""

    def __init__(self, timer: Any) -> None:
        self.timer = timer
        self.originals: dict[str, Callable[..., None]] = {}

    def _wrap(self, name: str, label: Callable[..., str]) -> None:
        original = getattr(self.timer, name)
        self.originals[name] = original

        def marked(*args: Any) -> None:
            _mark(label(*args))
            original(*args)

        setattr(self.timer, name, marked)

    def install(self) -> "TimerMarks":
        self._wrap("begin", lambda train: OUTSIDE_FORWARD)
        self._wrap("module_starts", lambda unit: f"{FORWARD} {unit}")
        self._wrap("begin_backward", lambda: OUTSIDE_BACKWARD)
        self._wrap("unpacked", lambda unit: f"{BACKWARD} {unit}")
        self._wrap("end_backward", lambda: END)
        return self

    def remove(self) -> None:
        for name in self.originals:
            delattr(self.timer, name)  # the class's method again
        self.originals = {}


@dataclass
class Profiled(L.Callback):
    """Profiles steps ``first`` .. ``first + count - 1`` (0-based), the engine's timings of each beside."""

    first: int
    count: int
    device: str
    trace: Path
    timings: list[StepProfile] = field(default_factory=list)
    unit_names: list[str] = field(default_factory=list)
    _profiler: Optional[profile] = None
    _marks: Optional[TimerMarks] = None

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.first:
            self._profiler = profile(activities=_activities(self.device), experimental_config=_all_threads(self.device))
            self._profiler.__enter__()
        if self._profiler is not None:
            self._marks = TimerMarks(trainer.strategy.engine.timer).install()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._profiler is None or self._marks is None:
            return
        self._marks.remove()
        timer = trainer.strategy.engine.timer
        if timer is not self._marks.timer:  # not on a fixed placement after warm-up steps; said, as the table would be wrong
            print(f"step {trainer.global_step}: the engine was replaced inside the step; its marks are the old engine's", flush=True)
        self.timings.append(timer.last_timing)  # read now: it waits for the step's marks on the GPU
        self.unit_names = timer.profile.unit_names
        if trainer.global_step == self.first + self.count:  # counted after the optimizer step
            self._profiler.__exit__(None, None, None)
            self._profiler.export_chrome_trace(str(self.trace))
            self._profiler = None


def _activities(device: str) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]


def _all_threads(device: str) -> Any:
    """On the CPU the emulated device's copies run on threads of their own, which the profiler
    records only when asked to (torch >= 2.7); on a GPU the copy streams are recorded anyway."""
    if device == "cuda":
        return None
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None


# -- the trace as work on lanes (streams on a GPU, threads on the CPU) ---------------------------------


@dataclass(frozen=True)
class Work:
    lane: str
    start: float
    end: float
    launched: float  # on the host: when it was queued (a kernel's launch), or when it ran (a CPU operator)
    copy: bool


_GPU_WORK = {"kernel": False, "gpu_memcpy": True, "gpu_memset": False}
_CPU_COPIES = ("aten::copy_", "aten::empty", "aten::empty_strided")


def gpu_work(events: list[dict]) -> list[Work]:
    """Kernels, copies and memsets on each stream, each with its launch's time on the host."""
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    out = []
    for e in events:
        if e.get("cat") in _GPU_WORK and e.get("ph") == "X":
            args = e.get("args", {})
            stream = f"stream {args.get('stream', e.get('tid'))}"
            out.append(Work(stream, e["ts"], e["ts"] + e["dur"], launches.get(args.get("correlation"), e["ts"]), _GPU_WORK[e["cat"]]))
    return out


def cpu_work(events: list[dict]) -> list[Work]:
    """Each thread's outermost operators (the emulated device's links copy on threads of their own,
    the update worker works on its own)."""
    by_thread: dict[Any, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X":
            by_thread[e["tid"]].append(e)
    out = []
    for tid, ops in by_thread.items():
        end = float("-inf")
        for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= end:  # not inside the operator before it
                out.append(Work(f"thread {tid}", e["ts"], e["ts"] + e["dur"], e["ts"], e["name"] in _CPU_COPIES))
                end = e["ts"] + e["dur"]
    return out


def union(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(spans: list[Span]) -> float:
    return sum(end - start for start, end in spans)


def intersect(a: list[Span], b: list[Span]) -> list[Span]:
    """Of two unions: the time in both."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def gaps(spans: list[Span]) -> list[Span]:
    """Of a union: the idle time between its first start and its last end."""
    return [(a[1], b[0]) for a, b in zip(spans, spans[1:])]


@dataclass
class Streams:
    """The profiled steps' lanes: each one's busy time, which is compute and which copy."""

    busy: dict[str, float]
    compute: str
    copies: list[str]
    overlapped: float
    idle_while_copying: float


def streams(work: list[Work]) -> Streams:
    lanes: dict[str, list[Work]] = defaultdict(list)
    for w in work:
        lanes[w.lane].append(w)
    busy = {lane: length(union([(w.start, w.end) for w in ws])) for lane, ws in lanes.items()}
    computing = {lane: length(union([(w.start, w.end) for w in ws if not w.copy])) for lane, ws in lanes.items()}
    compute = max(computing, key=lambda lane: computing[lane])
    copies = [lane for lane in lanes if lane != compute and computing[lane] <= busy[lane] / 2]  # mostly copying
    on_compute = union([(w.start, w.end) for w in lanes[compute]])
    copying = union([(w.start, w.end) for lane in copies for w in lanes[lane]])
    return Streams(busy, compute, copies, length(intersect(on_compute, copying)), length(intersect(gaps(on_compute), copying)))


# -- the engine's intervals, and the compute launched in each -------------------------------------------


def marks(events: list[dict]) -> list[tuple[float, str, Optional[int]]]:
    """(time, part, unit) of each of the engine's marks, in order."""
    out = []
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith(MARK):
            words = e["name"][len(MARK):].split(" ")
            unit = int(words[-1]) if words[-1].isdigit() else None
            out.append((e["ts"], " ".join(words[:-1]) if unit is not None else " ".join(words), unit))
    return sorted(out, key=lambda m: m[0])


def per_unit(work: list[Work], lane: str, found: list[tuple[float, str, Optional[int]]]) -> dict[tuple[str, int], float]:
    """Seconds of ``lane``'s work launched in each of the engine's forward and backward intervals of
    a unit, as the engine counts them: a forward interval that backward's start closes is outside
    forward (the head and the loss)."""
    parts = [part for _, part, _ in found]
    for k in range(len(found) - 1):
        if parts[k] == FORWARD and parts[k + 1] == OUTSIDE_BACKWARD:
            parts[k] = OUTSIDE_FORWARD
    times = [t for t, _, _ in found]
    seconds: dict[tuple[str, int], float] = defaultdict(float)
    for w in work:
        k = bisect.bisect_right(times, w.launched) - 1
        if w.lane == lane and k >= 0 and parts[k] in (FORWARD, BACKWARD):
            unit = found[k][2]
            assert unit is not None
            seconds[(parts[k], unit)] += (w.end - w.start) / 1e6
    return seconds


# -- the run and the report -------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def engine_seconds(timings: list[StepProfile]) -> dict[tuple[str, int], float]:
    """The engine's compute seconds of each unit's forward and backward over the profiled steps."""
    out: dict[tuple[str, int], float] = defaultdict(float)
    for timing in timings:
        for part, seconds in ((FORWARD, timing.forward_seconds), (BACKWARD, timing.backward_seconds)):
            for unit, s in seconds.items():
                out[(part, unit)] += s
    return out


def lanes_table(lanes: Streams) -> None:
    print("\n| lane | kind | busy (ms) |\n|---|---|---|")
    for lane, busy in sorted(lanes.busy.items(), key=lambda kv: -kv[1]):
        kind = "compute" if lane == lanes.compute else "copy" if lane in lanes.copies else "other"
        print(f"| {lane} | {kind} | {busy / 1e3:.2f} |")


def units_table(names: list[str], engine: dict[tuple[str, int], float], profiler: dict[tuple[str, int], float]) -> list[float]:
    """The engine's and the profiler's times of each unit; returns each unit's ratio (forward and backward together)."""
    print("\n| unit | engine forward (ms) | profiler forward (ms) | ratio | engine backward (ms) | profiler backward (ms) | ratio |\n|---|---|---|---|---|---|---|")
    ratios = []
    for unit, name in enumerate(names):
        cells = [(engine.get((part, unit), 0.0) * 1e3, profiler.get((part, unit), 0.0) * 1e3) for part in (FORWARD, BACKWARD)]
        print(f"| {name} | " + " | ".join(f"{e:.3f} | {p:.3f} | {_ratio(e, p)}" for e, p in cells) + " |")
        ours, theirs = (sum(c) for c in zip(*cells))
        if theirs > 0:
            ratios.append(ours / theirs)
    return ratios


def report(profiled: Profiled, events: list[dict], device: str) -> str:
    """The tables, and the line that sums them up."""
    work = gpu_work(events) if device == "cuda" else cpu_work(events)
    lanes = streams(work)
    lanes_table(lanes)
    engine, profiler = engine_seconds(profiled.timings), per_unit(work, lanes.compute, marks(events))
    ratios = units_table(profiled.unit_names, engine, profiler)
    ours, theirs = sum(engine.values()), sum(profiler.values())
    within = sum(abs(r - 1) <= 0.1 for r in ratios)
    total = ours / theirs if theirs > 0 else float("nan")
    copies = sum(lanes.busy[c] for c in lanes.copies)
    return (f"timeline: compute {lanes.busy[lanes.compute] / 1e3:.1f} ms busy, copies {copies / 1e3:.1f} ms ({len(lanes.copies)} lanes), "
            f"overlapped {lanes.overlapped / 1e3:.1f} ms, compute idle while copying {lanes.idle_while_copying / 1e3:.1f} ms; the engine's unit times "
            f"{ours * 1e3:.1f} ms against the profiler's {theirs * 1e3:.1f} ms: {total:.2f} (median unit {statistics.median(ratios) if ratios else float('nan'):.2f}, "
            f"{within} of {len(ratios)} within 10%; target within 10%: {'met' if abs(total - 1) <= 0.1 else 'not met'})")


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, layers=12, width=1024, seq_len=1024, batch_size=8, steps=2, warmup=2)
    parser.add_argument("--precision", default="bf16-mixed")
    add_device_argument(parser)
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    args.accelerator = "gpu" if args.device == "cuda" else "cpu"
    config = gpt2_config(args.layers, args.width, positions=args.seq_len)
    with tempfile.TemporaryDirectory() as root:
        profiled = Profiled(first=args.warmup, count=args.steps, device=args.device, trace=Path(root) / "trace.json")
        strategy = TieredStrategy(policy={"name": "auto", "placement": "host", "activations": "keep"})  # every unit streamed from host memory
        fit(strategy, config, args, root, StepTimer(), args.warmup + args.steps, precision=args.precision, callbacks=[profiled])
        events = json.loads(profiled.trace.read_text())["traceEvents"]
    print(f"GPT-2 {args.layers} layers x {args.width} wide, batch {args.batch_size} x {args.seq_len}, {args.precision}, every unit streamed from host "
          f"memory; steps {args.warmup + 1}-{args.warmup + args.steps} profiled on {args.device}")
    print(report(profiled, events, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
