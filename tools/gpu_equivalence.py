"""Which tiered configurations train as plain Lightning does on this GPU: a small GPT-2 for a few
steps under each, beside plain Lightning, and the first step whose loss differs.

    python tools/gpu_equivalence.py [--steps 3]
    CUDA_LAUNCH_BLOCKING=1 python tools/gpu_equivalence.py   # every kernel synchronous: a difference
                                                             # that goes away is a missing wait

A difference from the second step on, with the first equal, is in the update or in what the next
forward reads; float32 rounding (the host's AdamW against CUDA's) moves losses by ~1e-7 relative.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning as L  # noqa: E402

from offload_strategy import TieredStrategy  # noqa: E402
from tests.helpers import PARAMETERS_ONLY, train  # noqa: E402
from tests.test_offload import gpt2_4l, param_bytes  # noqa: E402

ACCELERATOR = os.environ.get("EQUIVALENCE_ACCELERATOR", "gpu")
VARIANTS = {
    "fill": PARAMETERS_ONLY,
    "fill, no prefetch": {**PARAMETERS_ONLY, "prefetch": False},
    "fill, updates after backward": {**PARAMETERS_ONLY, "update_during_backward": False},
    "fill, gradients copied": {**PARAMETERS_ONLY, "gradient_reserve": 1.0},
    "zero3_offload": "zero3_offload",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.3, 0.5, 1.1], help="gpu_memory as a fraction of the parameter bytes")
    parser.add_argument("--weights", default=None, choices=list(VARIANTS), help="for this variant: the weights that differ after each of the steps")
    args = parser.parse_args()
    if args.weights:
        return weights_table(VARIANTS[args.weights], args)
    total = param_bytes(gpt2_4l)
    blocking = os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"
    with tempfile.TemporaryDirectory() as root:
        plain, _, _ = train("auto", Path(root) / "plain", make_model=gpt2_4l, accelerator="gpu", max_steps=args.steps)
        print(f"\nlaunch blocking: {blocking}; plain losses {[round(x, 6) for x in plain]}\n")
        print("| policy | gpu_memory / parameters | first step differing | max relative loss difference | units gpu/host |")
        print("|---|---|---|---|---|")
        for name, policy in VARIANTS.items():
            for fraction in args.fractions:
                strategy = TieredStrategy(policy=policy, gpu_memory=int(fraction * total), host_memory="1GiB")
                try:
                    losses, _, _ = train(strategy, Path(root) / f"{name}-{fraction}", make_model=gpt2_4l, accelerator="gpu", max_steps=args.steps)
                except Exception as err:  # noqa: BLE001 (a table row, not a crash)
                    print(f"| {name} | {fraction} | {type(err).__name__}: {str(err)[:80]} | - | - |")
                    continue
                diffs = [abs(a - b) / abs(b) for a, b in zip(losses, plain)]
                first = next((i for i, d in enumerate(diffs) if d > 1e-6), None)
                m = strategy.metrics()
                homes = f"{int(m.get('units/gpu', 0))}/{int(m.get('units/host', 0))}"
                print(f"| {name} | {fraction} | {'-' if first is None else first} | {max(diffs):.2e} | {homes} |", flush=True)
    return 0


class _Seen(L.Callback):
    """Per step: where the units are, the cache's misses, and the order of the updates on the worker."""

    def __init__(self) -> None:
        self.rows: list[str] = []

    def on_train_batch_end(self, trainer, *args) -> None:  # type: ignore[no-untyped-def]
        engine, m = trainer.strategy.engine, trainer.strategy.metrics()
        updates = [i for i, _, _ in engine.updater.log] if engine is not None else []
        self.rows.append(f"gpu/host {m.get('units/gpu', 0):.0f}/{m.get('units/host', 0):.0f} miss {m.get('cache/miss_rate', 0):.2f} "
                         f"direct {m.get('units/direct_gradients', 0):.0f} worker updates {updates}")


def weights_table(policy: object, args: argparse.Namespace) -> int:
    """After 1..steps steps: the parameters that differ from plain Lightning's, largest first."""
    total = param_bytes(gpt2_4l)
    with tempfile.TemporaryDirectory() as root:
        for steps in range(1, args.steps + 1):
            plain, plain_weights, _ = train("auto", Path(root) / f"plain{steps}", make_model=gpt2_4l, accelerator=ACCELERATOR, max_steps=steps)
            for fraction in args.fractions:
                strategy = TieredStrategy(policy=policy, gpu_memory=int(fraction * total), host_memory="1GiB")
                seen = _Seen()
                losses, weights, _ = train(strategy, Path(root) / f"t{steps}-{fraction}", make_model=gpt2_4l, accelerator=ACCELERATOR, max_steps=steps,
                                           extra_callbacks=(seen,))
                print("  per step:", seen.rows)
                diffs = sorted(((float((weights[k].float() - v.float()).abs().max()), k) for k, v in plain_weights.items()), reverse=True)
                print(f"after {steps} steps, gpu_memory {fraction}: losses equal {[a == b for a, b in zip(losses, plain)]}; "
                      f"{sum(d > 1e-6 for d, _ in diffs)} of {len(diffs)} tensors differ by > 1e-6: "
                      + ", ".join(f"{k} {d:.1e}" for d, k in diffs[:6]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
