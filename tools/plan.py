"""Make a plan for a configured job and write it to a file, or show a plan file.

    python tools/plan.py --out plan.json                                  # the default job's plan
    python tools/plan.py --out plan.json model=gpt2_small strategy.gpu_memory=64MiB policy.activations=auto
    python tools/plan.py --show plan.json

Making a plan runs the job's first ``--steps`` training steps (the planner decides from what it
measures there: with ``policy.activations=auto`` the first step profiles the blocks), then writes
every unit's home and every block's activation policy, with what they imply (each unit's compute
mode, where its gradient is produced, where its optimizer states live) and the step model's
predicted breakdown. ``strategy.plan_file=plan.json`` runs the
plan again without planning; edit the file to try another placement.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def show(path: Path) -> None:
    from offload_strategy import format_bytes
    from offload_strategy.planning.plan_file import load_plan

    plan = load_plan(path)
    print(f"{path}: {len(plan.units)} units" + (f", budgets {', '.join(f'{k} {format_bytes(v)}' for k, v in plan.budgets.items())}" if plan.budgets else ""))
    print("\n| unit | name | bytes | home | mode | gradient | optimizer states |\n|---|---|---|---|---|---|---|")
    for index, unit in enumerate(plan.units):
        print(f"| {index} | {unit.name} | {format_bytes(unit.nbytes)} | {unit.home} | {unit.mode or '-'} | {unit.gradient or '-'} | {unit.states or '-'} |")
    totals = Counter()
    for unit in plan.units:
        totals[unit.home] += unit.nbytes
    print("\nparameters by home: " + ", ".join(f"{home} {format_bytes(n)} ({sum(u.home == home for u in plan.units)} units)" for home, n in sorted(totals.items())))
    if plan.activations is not None:
        counts = Counter(plan.activations)
        print(f"activations per block: {' '.join(plan.activations)} ({', '.join(f'{n} {p}' for p, n in sorted(counts.items()))})")
    p = plan.prediction
    if p:
        print(f"predicted step (the step model on the last timed step's compute): {p['step_seconds'] * 1e3:.1f} ms = forward "
              f"{p['forward_seconds'] * 1e3:.1f} + backward {p['backward_seconds'] * 1e3:.1f} + updates after backward "
              f"{p['update_tail_seconds'] * 1e3:.1f}; {p['exposed_seconds'] * 1e3:.1f} ms of it transfers and updates not hidden "
              f"behind compute; {format_bytes(p['h2d_bytes'])} copied into the GPU tier")


def make(out: Path, steps: int, overrides: list[str]) -> None:
    import lightning as L
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from experiments.train import build_strategy

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[*overrides, "logger=none", f"trainer.max_steps={steps}"])
    L.seed_everything(cfg.seed)
    datamodule = instantiate(cfg.data)
    module = instantiate(cfg.model)
    strategy = build_strategy(cfg, instantiate(cfg.hardware))
    if isinstance(strategy, str):
        raise SystemExit(f"strategy.name={strategy!r}: only the tiered strategy makes plans.")

    class Dump(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            strategy.dump_plan(out)

    trainer = instantiate(cfg.trainer, strategy=strategy, logger=False, callbacks=[Dump()], enable_checkpointing=False,
                          limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(out.parent))
    trainer.fit(module, datamodule=datamodule)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the plan")
    parser.add_argument("--show", type=Path, help="a plan file to print")
    parser.add_argument("--steps", type=int, default=2, help="training steps to run before writing the plan")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the job, as for experiments/train.py")
    args = parser.parse_args(argv)
    if args.show is None and args.out is None:
        parser.error("give --out PLAN.json to make a plan, or --show PLAN.json to print one")
    if args.out is not None:
        make(args.out, args.steps, args.overrides)
    show(args.show or args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
