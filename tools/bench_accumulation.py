"""Step time under gradient accumulation: plain Lightning beside the tiered strategy with every
unit's gradients copied home from the GPU tier (``gradient_reserve=1``, CUDA's default), unthrottled
and with the copies throttled to a PCIe link.

    python tools/bench_accumulation.py
    python tools/bench_accumulation.py --accumulate 4 --layers 4 --width 256 --optimizer-steps 8 --repeats 3

The modes are interleaved round by round, so that a noisy machine affects them alike. Reported:
the median time of a micro-batch that only accumulates (neither the first of its step nor the
one that ends it with the update), and the median time of a whole optimizer step (its
micro-batches together), over the measured steps (the first ``--warmup`` optimizer steps of each
run left out: they profile and place).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import lightning as L  # noqa: E402

from offload_strategy import TieredStrategy, format_bytes  # noqa: E402
from offload_strategy.demos import PARAMETERS_ONLY, CausalLM, SyntheticTokens, gpt2_config  # noqa: E402
from tools.common import parameter_bytes  # noqa: E402


class MicroBatchTimer(L.Callback):
    """Wall time of every micro-batch, by its place in its optimizer step."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.times: list[tuple[int, float]] = []  # (position in the step, seconds)
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.times.append((batch_idx % self.accumulate, time.perf_counter() - self._start))


@dataclass
class Mode:
    name: str
    make_strategy: Callable[[], Union[str, L.pytorch.strategies.Strategy]]
    later: list[float] = field(default_factory=list)  # micro-batches that only accumulate
    steps: list[float] = field(default_factory=list)  # whole optimizer steps


def run_once(mode: Mode, config: dict[str, Any], args: argparse.Namespace, root: str) -> None:
    L.seed_everything(0, verbose=False)
    micro_batches = args.accumulate * args.optimizer_steps
    model = CausalLM(family="gpt2", config=config, lr=1e-3)
    data = SyntheticTokens(seq_len=args.seq_len, batch_size=args.batch_size, num_tokens=args.seq_len * args.batch_size * (micro_batches + 2) * 2)
    timer = MicroBatchTimer(args.accumulate)
    trainer = L.Trainer(strategy=mode.make_strategy(), accelerator="cpu", devices=1, max_steps=args.optimizer_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[timer], default_root_dir=root, accumulate_grad_batches=args.accumulate)
    trainer.fit(model, datamodule=data)
    measured = timer.times[args.warmup * args.accumulate :]
    mode.later += [t for position, t in measured if 0 < position < args.accumulate - 1]
    for first in range(0, len(measured) - args.accumulate + 1, args.accumulate):
        mode.steps.append(sum(t for _, t in measured[first : first + args.accumulate]))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--optimizer-steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps of each run left out of the medians")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-fraction", type=float, default=0.25, help="gpu_memory as a fraction of the parameter bytes")
    parser.add_argument("--link", default="a100_80g", help="known machine whose PCIe figures throttle the copies of the throttled mode")
    args = parser.parse_args(argv)
    if args.accumulate < 3:
        parser.error(f"--accumulate {args.accumulate}: give 3 or more, so that a step has micro-batches that only accumulate.")

    config = gpt2_config(args.layers, args.width)
    param_bytes = parameter_bytes(config)
    gpu = int(args.gpu_fraction * param_bytes)
    copied = {**PARAMETERS_ONLY, "gradient_reserve": 1.0}
    modes = [
        Mode("lightning (auto)", lambda: "auto"),
        Mode(f"tiered, gpu {args.gpu_fraction:.0%}, host, gradients copied home",
             lambda: TieredStrategy(gpu_memory=gpu, host_memory="4GiB", policy=copied)),
        Mode(f"tiered, gpu {args.gpu_fraction:.0%}, host, gradients copied home, {args.link} link",
             lambda: TieredStrategy(gpu_memory=gpu, host_memory="4GiB", hardware=args.link, policy={**copied, "throttle": True})),
    ]
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            for mode in modes:
                print(f"round {repeat + 1}/{args.repeats}: {mode.name}", file=sys.stderr, flush=True)
                run_once(mode, config, args, root)

    print(f"\nGPT-2 {args.layers} layers x {args.width} wide ({format_bytes(param_bytes)} fp32), batch {args.batch_size} x {args.seq_len}, "
          f"accumulate_grad_batches={args.accumulate}, gpu_memory {format_bytes(gpu)}; medians over {args.repeats} interleaved runs of "
          f"{args.optimizer_steps} optimizer steps ({args.warmup} dropped)\n")
    print("| mode | accumulating micro-batch (ms) | optimizer step (ms) | step vs lightning |")
    print("|---|---|---|---|")
    base = statistics.median(modes[0].steps)
    for mode in modes:
        step = statistics.median(mode.steps)
        print(f"| {mode.name} | {statistics.median(mode.later) * 1e3:.1f} | {step * 1e3:.1f} | {step / base:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
