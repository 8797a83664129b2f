"""The step model's prediction beside the measured step, on this machine, for several placements.

    python tools/validate_cost_model.py
    python tools/validate_cost_model.py --models tiny small --fractions 0.25 0.45 0.65 0.85

Trains GPT-2s with the tiered strategy at several GPU-tier budgets (each a different placement:
units kept in the GPU tier, streaming buffers), with the emulated GPU tier's copies throttled to
``--link-gbps`` (slow enough that transfers matter on a CPU). The warm-up steps' own timings after
the first (compute per unit with waits left out, the compute outside units, the update of every
unit; ``TieredEngine.last_timing``), averaged, and the run's placement go into
``planning/cost_model.py``; the table lists the predicted and the measured median of the steps
after it, the step and its phases, side by side, and the peak of the GPU tier's parameter memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from offload_strategy import TieredStrategy, format_bytes  # noqa: E402
from offload_strategy.profiling import mean_timing  # noqa: E402
from offload_strategy.planning.cost_model import GPU, StepPrediction  # noqa: E402
from tools.common import PARAMETERS_ONLY, StepTimer, fit, gpt2_config, parameter_bytes  # noqa: E402

# (layers, width, sequence, batch, link GB/s): the tiny GPT of conf/model/gpt2_tiny.yaml, and
# GPT-2 small's 12 x 768 (with the byte vocabulary the tools train on)
MODELS = {"tiny": (4, 256, 128, 8, 0.1), "small": (12, 768, 128, 2, 0.5)}


class Probe(StepTimer):
    """Each step's phases, and the step model's prediction from the warm-up steps' timings."""

    def __init__(self, warmup: int) -> None:
        super().__init__()
        self.warmup = warmup
        self.phases: list[tuple[float, float, float]] = []  # forward, backward, after backward
        self.prediction: Optional[StepPrediction] = None
        self.predicted_peak = 0
        self.homes = "-"
        self._marks = [0.0, 0.0]
        self.timings: list[Any] = []

    def on_before_backward(self, trainer, *args: Any) -> None:
        self._marks[0] = time.perf_counter()

    def on_after_backward(self, trainer, *args: Any) -> None:
        self._marks[1] = time.perf_counter()

    def on_train_batch_end(self, trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        end = time.perf_counter()
        self.phases.append((self._marks[0] - self._start, self._marks[1] - self._marks[0], end - self._marks[1]))
        engine = trainer.strategy.engine
        if engine is None or engine.last_timing is None:
            return
        if len(self.times) > 1:  # the first step is cold: lazy initialisation, first allocations
            self.timings.append(engine.last_timing)
        if len(self.times) != self.warmup:
            return
        self.prediction = trainer.strategy.predicted_step(mean_timing(self.timings))
        self.predicted_peak = sum(s.unit.nbytes for s in engine.states if s.home == GPU) + sum(
            size * count for size, count in engine.placement.device_slots.items())
        self.homes = "/".join(str(sum(s.home == h for s in engine.states)) for h in ("gpu", "host", "nvme"))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["tiny"], choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5, help="steps before the one whose timing is the model's input")
    parser.add_argument("--link-gbps", type=float, default=None, help="throttle of the emulated PCIe link, GB/s each way (default: per model)")
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.25, 0.45, 0.65, 0.85], help="gpu_memory as fractions of the parameter bytes")
    args = parser.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            layers, width, seq_len, batch, link = MODELS[name]
            link = args.link_gbps or link
            config = gpt2_config(layers, width, positions=seq_len)
            param_bytes = parameter_bytes(config)
            run = argparse.Namespace(seq_len=seq_len, batch_size=batch)
            hardware = {"name": "throttled", "gpu": "emulated", "gpu_memory": "80GiB", "gpu_bf16_tflops": None, "gpu_fp16_tflops": None,
                        "h2d_gbps": link, "d2h_gbps": link, "host_memory": "16GiB", "cpu_cores": os.cpu_count() or 1}
            for fraction in args.fractions:
                print(f"{name}: gpu_memory {fraction:.0%} of the parameters", file=sys.stderr, flush=True)
                probe = Probe(args.warmup)
                strategy = TieredStrategy(gpu_memory=int(fraction * param_bytes), host_memory="4GiB", hardware=hardware, policy={**PARAMETERS_ONLY, "throttle": True})
                fit(strategy, config, run, root, probe, args.steps)
                after = slice(args.warmup, None)
                measured = [statistics.median(p[k] for p in probe.phases[after]) for k in range(3)]
                peak = max(m.get("tier/gpu_peak_bytes", 0.0) for m in probe.metrics[after])
                rows.append((f"{name} {layers}x{width}", link, fraction, probe.homes, probe.prediction, statistics.median(probe.times[after]), measured,
                             probe.predicted_peak, peak))

    print(f"\nMedian of each run's steps after the {args.warmup} warm-up steps; phases: forward (to the loss), backward, and the "
          "optimizer step after it\n")
    print("| model | link GB/s | gpu_memory | units gpu/host/nvme | predicted step (ms) | measured step (ms) | predicted / measured "
          "| forward pred / meas (ms) | backward pred / meas | after backward pred / meas | GPU-tier peak pred / meas |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for model, link, fraction, homes, p, step, (forward, backward, after), predicted_peak, peak in rows:
        if p is None:
            print(f"| {model} | {link} | {fraction:.0%} | {homes} | - | {step * 1e3:.1f} | - | | | | |")
            continue
        errors.append(abs(p.seconds - step) / step)
        print(f"| {model} | {link} | {fraction:.0%} | {homes} | {p.seconds * 1e3:.1f} | {step * 1e3:.1f} | {p.seconds / step:.2f} "
              f"| {p.forward_seconds * 1e3:.1f} / {forward * 1e3:.1f} | {p.backward_seconds * 1e3:.1f} / {backward * 1e3:.1f} "
              f"| {p.update_tail_seconds * 1e3:.1f} / {after * 1e3:.1f} | {format_bytes(predicted_peak)} / {format_bytes(int(peak))} |")
    if errors:
        print(f"\nmedian |predicted - measured| / measured: {statistics.median(errors):.1%} over {len(errors)} placements "
              f"(largest {max(errors):.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
