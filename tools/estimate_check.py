"""Check ``offload_strategy.estimate`` against real runs: for held-out models (a tiny Llama and a
GPT-2 built with transformers from config with random weights, and a CNN), the estimate of each
preset's least ``gpu_memory`` beside the least the strategy accepts, found by bisection over real
training runs of a few steps on this machine, and the time the estimate took.

    python tools/estimate_check.py                         # every held-out model, policy auto
    python tools/estimate_check.py --models llama --policies auto fill zero3_offload
    python tools/estimate_check.py --host --models gpt2     # the host_memory figure: runs at 75%, 90%, 105% of it
    python tools/estimate_check.py --timing-only llama_70b --hardware h100_80g   # the estimate command, timed

A run is accepted when it trains ``--steps`` steps (the profiled step, the warm ones and the plan's
first) without the strategy refusing its budget; the bisection stops within 1% of the least.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from offload_strategy.demos import HELD_OUT, example_batch  # noqa: E402

STEPS = 5  # the profiled step, two warm ones, the step the plan is made before, and one under it


def run(name: str, policy: str, gpu_memory: int, steps: int = STEPS, host_memory: Optional[int] = None) -> Optional[str]:
    """Train ``steps`` steps of the held-out model under the tiered strategy; None when the
    strategy accepted the budget, its refusal otherwise."""
    from offload_strategy import TieredStrategy

    L.seed_everything(0, verbose=False)
    model = HELD_OUT[name]()
    batches = [example_batch(name, seed) for seed in range(steps)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(strategy=TieredStrategy(policy=policy, gpu_memory=gpu_memory, host_memory=host_memory), accelerator="cpu", devices=1, max_steps=steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, default_root_dir=root)
        try:
            trainer.fit(model, loader)
        except (ValueError, MemoryError) as refusal:  # MemoryBudgetError and the planner's refusals are ValueErrors
            return str(refusal)
    return None


def true_least(name: str, policy: str, high: int, steps: int = STEPS) -> int:
    """The least gpu_memory the strategy accepts for the held-out model, within 1% (bisected)."""
    low = 0
    if run(name, policy, high, steps) is not None:
        raise SystemExit(f"{name} under {policy}: refused even at {high:,} bytes; give a larger --upper.")
    while high - low > max(4096, high // 100):
        middle = (low + high) // 2
        if run(name, policy, middle, steps) is None:
            high = middle
        else:
            low = middle
    return high


def check(names: list[str], policies: list[str]) -> None:
    from offload_strategy import format_bytes
    from offload_strategy.estimate import estimate

    print("| model | policy | estimate | true least (bisected over runs) | estimate / least | estimate took |")
    print("|---|---|---|---|---|---|")
    for name in names:
        for policy in policies:
            started = time.perf_counter()
            guess = estimate(HELD_OUT[name](), example_batch(name), policy=policy)[policy].gpu_memory  # this machine: its attention kernel
            took = time.perf_counter() - started
            least = true_least(name, policy, 4 * guess)
            print(f"| {name} | {policy} | {format_bytes(guess)} | {format_bytes(least)} | {guess / least:.3f} | {took:.2f} s |", flush=True)


def check_host(names: list[str], policies: list[str]) -> None:
    """The host figure: runs at the estimated gpu_memory +5% with host_memory at 75%, 90% and 105% of its estimate."""
    from offload_strategy import format_bytes
    from offload_strategy.estimate import estimate

    print("| model | policy | host estimate | units gpu/host/nvme | at 75% | at 90% | at 105% |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        for policy in policies:
            row = estimate(HELD_OUT[name](), example_batch(name), policy=policy)[policy]
            cells = ["accepted" if run(name, policy, int(1.05 * row.gpu_memory), host_memory=int(f * row.host_memory)) is None else "refused"
                     for f in (0.75, 0.9, 1.05)]
            print(f"| {name} | {policy} | {format_bytes(row.host_memory)} | {row.units} | {' | '.join(cells)} |", flush=True)


def time_hydra(overrides: list[str]) -> None:
    from offload_strategy.cli import main

    started = time.perf_counter()
    main(["estimate", *overrides])
    print(f"\nestimated in {time.perf_counter() - started:.1f} s")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(HELD_OUT), choices=list(HELD_OUT))
    parser.add_argument("--policies", nargs="*", default=["auto"])
    parser.add_argument("--host", action="store_true", help="check the host_memory figure instead (runs at 75%%, 90%% and 105%% of it)")
    parser.add_argument("--timing-only", action="store_true", help="only time the estimate of a Hydra model (overrides as for the CLI)")
    parser.add_argument("command", nargs="*", help="with --timing-only: the estimate command's model and options, e.g. llama_70b --hardware h100_80g")
    args, options = parser.parse_known_args(argv)
    if args.timing_only:
        time_hydra([*args.command, *options])
    elif args.host:
        check_host(args.models, args.policies)
    else:
        check(args.models, args.policies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
