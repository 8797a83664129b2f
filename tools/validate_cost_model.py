"""The step model's prediction beside the measured step, on this machine, for several placements.

    python tools/validate_cost_model.py
    python tools/validate_cost_model.py --models tiny small --fractions 0.25 0.45 0.65 0.85
    python tools/validate_cost_model.py --default-policy --fractions 2 3 4 6

Trains GPT-2s with the tiered strategy at several GPU-tier budgets (each a different placement:
units kept in the GPU tier, streaming buffers; a fraction of the parameters' bytes, beside the kept
blocks' activations, measured first in a step of their own), with the emulated GPU tier's copies throttled to
``--link-gbps`` (slow enough that transfers matter on a CPU). The warm-up steps' own timings after
the first (compute per unit with waits left out, the compute outside units, the update of every
unit; ``TieredEngine.last_timing``), averaged, and the run's placement go into
``planning/cost_model.py``; the table lists the predicted and the measured median of the steps
after it, the step and its phases, side by side, and the peak of the GPU tier's parameter memory.

``--nvme DIR`` keeps every unit on NVMe in ``DIR`` (``placement="nvme"``): the drive's rates the
step model prices with are the ``NvmeStore``'s on ``DIR``, measured first as ``offload-strategy probe``
measures them, so the table checks how the model schedules the drive's reads and writes beside
the link's copies and the updates, not a datasheet.

``--default-policy`` runs the default policy instead (``--fractions`` then count the parameter
bytes the GPU tier holds for parameters and activations together): the placement search and the
activation layout price their plan from the measured second step, as in a user's run; the table
lists the prediction the run reports (``plan/predicted_step_ms``: the joint search's, or the
layout's where the search did not run) beside the median of the steps under the plan
(``plan/measured_step_ms``), with the plan.
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
from offload_strategy.planning.profile import mean_timing  # noqa: E402
from offload_strategy.planning.cost_model import GPU, StepPrediction  # noqa: E402
from offload_strategy.lightning.recipe import gradient_hooks  # noqa: E402
from offload_strategy.demos import PARAMETERS_ONLY, gpt2_config  # noqa: E402
from tools.common import StepTimer, fit, parameter_bytes  # noqa: E402

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
        self._marks = [0.0]
        self.timings: list[Any] = []

    def on_fit_start(self, trainer, *args: Any) -> None:
        if gradient_hooks(trainer):  # the probe's own hooks, or another callback's
            raise SystemExit("a hook after backward (on_after_backward, on_before_optimizer_step) reads the gradients: every update would wait "
                             "until backward ends, a recipe the step model does not price; time the steps without it.")

    def on_before_backward(self, trainer, *args: Any) -> None:
        self._marks[0] = time.perf_counter()

    # No hook after backward: one there (``on_after_backward``) reads the gradients, so the
    # runtime would hold every update until backward ends, a recipe the prediction does not price.
    # What the step waited after backward is the engine's own count (``optimizer/exposed_ms``).
    def on_train_batch_end(self, trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        end = time.perf_counter()
        after = (self.metrics[-1].get("optimizer/exposed_ms", 0.0) if self.metrics else 0.0) / 1e3
        self.phases.append((self._marks[0] - self._start, end - self._marks[0] - after, after))
        engine = trainer.strategy.engine
        if engine is None or engine.timer.last_timing is None:
            return
        if len(self.times) > 1:  # the first step is cold: lazy initialisation, first allocations
            self.timings.append(engine.timer.last_timing)
        if len(self.times) != self.warmup:
            return
        self.prediction = trainer.strategy.predicted_step(mean_timing(self.timings))
        self.predicted_peak = sum(s.unit.nbytes for s in engine.states if s.home == GPU) + sum(
            size * count for size, count in engine.placement.device_slots.items())
        self.homes = "/".join(str(sum(s.home == h for s in engine.states)) for h in ("gpu", "host", "nvme"))


def default_policy_row(name: str, fraction: float, args: argparse.Namespace, root: str) -> tuple:
    """One run of the default policy at ``fraction`` of the parameter bytes: its plan, both
    predictions and the median step under the plan, or the refusal."""
    layers, width, seq_len, batch, link = MODELS[name]
    link = args.link_gbps or link
    config = gpt2_config(layers, width, positions=seq_len)
    budget = int(fraction * parameter_bytes(config))
    strategy = TieredStrategy(gpu_memory=budget, host_memory="4GiB", hardware=throttled(link), policy={"throttle": True})
    timer = Probe(args.steps + 1)  # its phases; no prediction of its own
    label = f"{name} {layers}x{width}"
    try:
        fit(strategy, config, argparse.Namespace(seq_len=seq_len, batch_size=batch), root, timer, args.steps)
    except ValueError as error:  # the GPU tier holds no plan: the refusal is the row
        return (label, link, budget, f"refused: {str(error)[:120]}...", "-", None, None, None, None)
    core = strategy.tiered
    last = timer.metrics[-1] if timer.metrics else {}
    homes = "/".join(str(int(last.get(f"units/{h}", 0))) for h in ("gpu", "host", "nvme")) if "units/host" in last else "all in the GPU tier"
    plan = core.activations.plan
    layout = " ".join(p.letter for p in plan.layout) if plan is not None else "-"
    check = core.prediction  # what the run itself reports: the last plan's prediction, the steps under it
    under = timer.phases[-len(check.measured):] if check.measured else []
    measured_phases = [statistics.median(p[k] for p in under) for k in range(3)] if under else None
    searched = core.planner.search_result if check.source == "placement search" else None
    predicted_phases = None
    if searched is not None:
        p = searched.parameters.prediction
        predicted_phases = (p.forward_seconds, p.backward_seconds + searched.seconds - p.seconds, p.update_tail_seconds)
    return (label, link, budget, f"{homes}, {layout}", check.source, check.predicted_seconds, check.measured_seconds(), predicted_phases, measured_phases)


def store_rates(path: Path) -> dict[str, Any]:
    """The NvmeStore's read and write rates on ``path`` (GB/s), as ``offload-strategy probe`` measures
    them (256 MiB, four threads, the best of three), as hardware spec fields."""
    from offload_strategy.memory.bandwidth import measure

    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path) as work:
        rows = {name: value for name, value, _ in measure(Path(work), 256 * 2**20, workers=4, repeat=3)}
    return {"nvme_read_gbps": float(rows["NvmeStore read"]), "nvme_write_gbps": float(rows["NvmeStore write"]), "nvme_count": 1}


def throttled(link: float) -> dict[str, Any]:
    return {"name": "throttled", "gpu": "emulated", "gpu_memory": "80GiB", "gpu_bf16_tflops": None, "gpu_fp16_tflops": None,
            "h2d_gbps": link, "d2h_gbps": link, "host_memory": "16GiB", "cpu_cores": os.cpu_count() or 1}


def print_default_policy(rows: list[tuple], steps: int) -> None:
    print(f"\nThe default policy: the plan's prediction beside the median of the steps run under it ({steps} steps per run)\n")
    print("| model | link GB/s | gpu_memory | units gpu/host/nvme, blocks | predicted by | predicted (ms) | measured (ms) | measured / predicted - 1 "
          "| forward pred / meas | backward pred / meas | after backward pred / meas |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for label, link, budget, plan, source, predicted, measured, predicted_phases, measured_phases in rows:
        error = "-"
        if predicted and measured:
            errors.append(measured / predicted - 1.0)
            error = f"{errors[-1]:+.1%}"
        shown = [f"{x * 1e3:.1f}" if x else "-" for x in (predicted, measured)]
        phases = [
            f"{a * 1e3:.1f} / {b * 1e3:.1f}" if predicted_phases else (f"- / {b * 1e3:.1f}" if measured_phases else "-")
            for a, b in zip(predicted_phases or (0, 0, 0), measured_phases or (0, 0, 0))
        ]
        print(f"| {label} | {link} | {format_bytes(budget)} | {plan} | {source} | {' | '.join(shown)} | {error} | {' | '.join(phases)} |")
    if errors:
        print(f"\nmedian |measured / predicted - 1| {statistics.median(abs(e) for e in errors):.1%} over {len(errors)} runs "
              f"(largest {max(errors, key=abs):+.1%})")


def kept_activations(config: dict[str, Any], run: argparse.Namespace, root: str) -> int:
    """The kept blocks' activations at their peak, as the first training step measures them (in a
    step of their own, nothing offloaded): the GPU tier counts them beside the parameters, whose
    share is then the fraction asked (they are placed again in it after the first step)."""
    strategy = TieredStrategy(policy=PARAMETERS_ONLY)
    fit(strategy, config, run, root, StepTimer(), 1)
    fixed = strategy.tiered.activations.fixed
    assert fixed is not None, "the first training step measures a kept layout"
    return fixed.peak_bytes


def placement_rows(args: argparse.Namespace, drive: dict[str, Any]) -> list[tuple]:
    """One run per model and GPU-tier fraction: its placement, the prediction from its warm-up
    steps, and the medians measured after them."""
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            layers, width, seq_len, batch, link = MODELS[name]
            link = args.link_gbps or link
            config = gpt2_config(layers, width, positions=seq_len)
            param_bytes = parameter_bytes(config)
            run = argparse.Namespace(seq_len=seq_len, batch_size=batch)
            hardware = {**throttled(link), **drive}
            kept = kept_activations(config, run, root)
            for fraction in args.fractions:
                print(f"{name}: gpu_memory {fraction:.0%} of the parameters", file=sys.stderr, flush=True)
                probe = Probe(args.warmup)
                strategy = TieredStrategy(gpu_memory=int(fraction * param_bytes) + kept, host_memory="4GiB", hardware=hardware, nvme_path=args.nvme,
                                          policy={**PARAMETERS_ONLY, "throttle": True, **({"placement": "nvme"} if args.nvme else {})})
                fit(strategy, config, run, root, probe, args.steps)
                after = slice(args.warmup, None)
                measured = [statistics.median(p[k] for p in probe.phases[after]) for k in range(3)]
                peak = max(m.get("tier/gpu_peak_bytes", 0.0) for m in probe.metrics[after])
                rows.append((f"{name} {layers}x{width}", link, fraction, probe.homes, probe.prediction, statistics.median(probe.times[after]), measured,
                             probe.predicted_peak, peak))
    return rows


def print_placements(rows: list[tuple], args: argparse.Namespace, drive: dict[str, Any]) -> None:
    """The table of ``placement_rows``, with the drive's measured rates first where units are on NVMe."""
    if drive:
        print(f"\nEvery unit on NVMe in {args.nvme}: the NvmeStore there reads {drive['nvme_read_gbps']:.2f} GB/s and writes "
              f"{drive['nvme_write_gbps']:.2f} GB/s (O_DIRECT where the file system takes it), the rates the model prices with")
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


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["tiny"], choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5, help="steps before the one whose timing is the model's input")
    parser.add_argument("--link-gbps", type=float, default=None, help="throttle of the emulated PCIe link, GB/s each way (default: per model)")
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.25, 0.45, 0.65, 0.85], help="gpu_memory as fractions of the parameter bytes")
    parser.add_argument("--default-policy", action="store_true", help="the default policy's plans and predictions, activations included")
    parser.add_argument("--nvme", type=Path, default=None, help="every unit on NVMe in this directory, priced at the rates measured there")
    args = parser.parse_args(argv)
    if args.nvme is not None and args.default_policy:
        raise SystemExit("--nvme fixes every unit's home on NVMe; --default-policy lets the search choose them: give one or the other.")

    if args.default_policy:
        with tempfile.TemporaryDirectory() as root:
            rows = []
            for name in args.models:
                for fraction in args.fractions:
                    print(f"{name}: the default policy, gpu_memory {fraction:.0%} of the parameters", file=sys.stderr, flush=True)
                    rows.append(default_policy_row(name, fraction, args, root))
        print_default_policy(rows, args.steps)
        return 0
    drive = store_rates(args.nvme) if args.nvme is not None else {}
    print_placements(placement_rows(args, drive), args, drive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
