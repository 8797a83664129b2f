"""Make a plan for a configured job and write it to a file, or show a plan file.

    python tools/plan.py --out plan.json                                  # the default job's plan
    python tools/plan.py --out plan.json model=gpt2_small strategy.gpu_memory=64MiB policy.activations=auto
    python tools/plan.py --from-shapes --out plan.json model=llama_7b hardware=rtx4090 trainer=gpu
    python tools/plan.py --show plan.json

Making a plan runs the job's first ``--steps`` training steps (the planner decides from what it
measures there: the first step records the order and, with ``policy.activations=auto``, profiles
the blocks; the warm steps after it price the plan, which the next step puts in place), then writes
every unit's home and every block's activation policy, with what they imply (each unit's compute
mode, where its gradient is produced, where its optimizer states live) and the step model's
predicted breakdown. ``strategy.plan_file=plan.json`` runs the
plan again without planning; edit the file to try another placement.

``--from-shapes`` plans without running anything, for a model or a machine that is not at hand:
the model is built on the meta device (no memory for its parameters, as ``tools/simulate.py``
builds it), its units and blocks are costed from their shapes and the ``hardware`` spec, and the
default policy's joint search (resident units, streaming buffers, block activation policies)
runs within the job's budgets: ``strategy.gpu_memory`` (default: the spec's GPU memory),
``strategy.host_memory`` (default: 95% of the spec's host memory, what the strategy finds
available on an idle machine) and ``strategy.nvme_memory``
(default: none). The budgets and every assumption are printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

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
        print(f"predicted step (the step model): {p['step_seconds'] * 1e3:.1f} ms = forward "
              f"{p['forward_seconds'] * 1e3:.1f} + backward {p['backward_seconds'] * 1e3:.1f} + updates after backward "
              f"{p['update_tail_seconds'] * 1e3:.1f}" + (f" + activation recomputes and swaps {p['layout_seconds'] * 1e3:.1f}" if p.get("layout_seconds") else "")
              + f"; {p['exposed_seconds'] * 1e3:.1f} ms of it transfers and updates not hidden "
              f"behind compute; {format_bytes(p['h2d_bytes'])} copied into the GPU tier")


def compose_job(overrides: list[str], output_dir: Path) -> Any:
    """The job's configuration as ``experiments/train.py`` would run it in ``output_dir``: paths
    written ``${hydra:runtime.output_dir}/...`` (an experiment's ``strategy.nvme_path``) resolve there."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[*overrides, "logger=none"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir.resolve())
    HydraConfig.instance().set_config(cfg)
    return cfg


def make(out: Path, steps: int, overrides: list[str]) -> None:
    import lightning as L
    from hydra.utils import instantiate

    from experiments.train import build_strategy

    cfg = compose_job([*overrides, f"trainer.max_steps={steps}"], out.parent)
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


def shapes_budgets(cfg: Any, hardware: Any) -> tuple[int, int, int]:
    """The job's budgets against the hardware spec's sizes (see the module docstring)."""
    from offload_strategy.config import Budget
    from offload_strategy.hardware import AVAILABLE_SHARE

    strategy = cfg.strategy
    gpu = Budget.parse(strategy.gpu_memory, "strategy.gpu_memory").resolve(hardware.gpu_memory)
    host = Budget.parse(strategy.host_memory, "strategy.host_memory").resolve(int(AVAILABLE_SHARE * hardware.host_memory))
    nvme = Budget.parse(strategy.get("nvme_memory"), "strategy.nvme_memory").resolve(0)
    return gpu, host, nvme


def gradient_life(cfg: Any) -> dict[str, bool]:
    """How long offloaded units' gradients live in the job, as the strategy decides it from the
    recipe: each unit is updated as its gradients complete (after its reduction, under data
    parallelism); with clipping by norm or accumulation one process's wait on NVMe, and
    data-parallel ranks keep them at home."""
    trainer = cfg.trainer
    single = int(trainer.get("devices", 1) or 1) == 1 and cfg.strategy.name != "tiered_ddp"
    waits = bool(trainer.get("gradient_clip_val")) or int(trainer.get("accumulate_grad_batches", 1) or 1) > 1
    return {"gradients_until_update": single or not waits, "spill_gradients": single and waits}


def make_from_shapes(out: Path, overrides: list[str], efficiency: float) -> None:
    from hydra.utils import instantiate

    from offload_strategy import format_bytes
    from offload_strategy.planning.auto import plan_auto
    from offload_strategy.config import compute_dtype
    from offload_strategy.planning.placement import GPU
    from offload_strategy.planning.plan_file import PlanFile, PlannedUnit, prediction_record, save_plan
    from tools.simulate import build, machine_of, parameter_links, unit_costs

    cfg = compose_job(overrides, out.parent)
    if cfg.policy.get("chunk_size"):
        raise SystemExit("--from-shapes plans transfer units as the model defines them; leave policy.chunk_size unset.")
    hardware = instantiate(cfg.hardware)
    precision = str(cfg.trainer.get("precision", "32-true"))
    started = time.perf_counter()
    try:
        model = build(cfg, hardware, precision in ("bf16-true", "16-true"), efficiency, dtype=compute_dtype(precision), mixed=precision.endswith("-mixed"))
    except ValueError as error:  # a machine probed without a GPU has no peak to price compute at
        raise SystemExit(f"{error} --from-shapes prices compute from the spec: name a known machine (hardware=rtx4090, ...) "
                         f"or give its peak (+hardware.gpu_{compute_dtype(precision)}_tflops=...).") from None
    gpu, host, nvme = shapes_budgets(cfg, hardware)
    machine = machine_of(hardware, nvme)
    owners = [0] * len(model.units)
    links = parameter_links(machine, sum(s.nbytes for s in model.sizes))
    plan = plan_auto(
        model.sizes, model.co_resident, [u.index for u in model.units], unit_costs(model, owners), machine, gpu_bytes=max(gpu - model.beside.in_blocks, 0), host_bytes=host,
        nvme_bytes=nvme, state_factor=model.state_factor, blocks=model.blocks, links=links, activation_host_bytes=host // 2,
        block_units=model.block_units, head=model.beside.head, **gradient_life(cfg),
    )
    chosen, prediction = plan.parameters.placement, plan.parameters.prediction
    units = []
    for unit in model.units:
        home = chosen.home[unit.index]
        trainable = any(p.requires_grad for p in unit.params)
        gradient = ("gpu" if home == GPU else "copied") if trainable else None
        units.append(PlannedUnit(unit.name, unit.nbytes, str(home), "resident" if home == GPU else "streamed", gradient, str(home) if trainable else None))
    layout = plan.activations.layout if plan.activations is not None else None
    save_plan(PlanFile(
        units=tuple(units), activations=tuple(str(p) for p in layout) if layout else None, budgets={"gpu": gpu, "host": host, "nvme": nvme},
        prediction=prediction_record(prediction, layout_seconds=plan.seconds - prediction.seconds),
    ), out)
    print(f"{model.name}: {model.parameters / 1e9:.2f} B parameters in {len(model.units)} units and {len(model.blocks)} blocks, {precision}, "
          f"{model.tokens:,} tokens per step, built on the meta device and planned in {time.perf_counter() - started:.1f} s")
    print(f"hardware {hardware.name} ({hardware.gpu}); budgets: GPU {format_bytes(gpu)}, host {format_bytes(host)}, NVMe {format_bytes(nvme)}; "
          f"compute priced at {efficiency:.0%} of the GPU's dense peak; the plan's step: {plan.seconds:.2f} s (step model, from shapes)\n")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the plan")
    parser.add_argument("--show", type=Path, help="a plan file to print")
    from offload_strategy.session.plans import TIMED_STEPS, WARM_UP_STEPS

    # the plan is made between the last timed step and the next, and put in place as that one starts
    planned = WARM_UP_STEPS + TIMED_STEPS + 1
    parser.add_argument("--steps", type=int, default=planned, help=f"training steps to run before writing the plan (default {planned}: planning "
                        f"prices warm steps {WARM_UP_STEPS + 1} to {WARM_UP_STEPS + TIMED_STEPS}; fewer write the set-up placement)")
    parser.add_argument("--from-shapes", action="store_true", help="plan from the model's shapes and the hardware spec, running nothing")
    parser.add_argument("--efficiency", type=float, default=0.5, help="--from-shapes: model FLOPs utilisation of the GPU's dense peak")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the job, as for experiments/train.py")
    args = parser.parse_intermixed_args(argv)  # Hydra overrides may come before or after the options
    if args.show is None and args.out is None:
        parser.error("give --out PLAN.json to make a plan, or --show PLAN.json to print one")
    if args.out is not None and args.from_shapes:
        make_from_shapes(args.out, args.overrides, args.efficiency)
    elif args.out is not None:
        make(args.out, args.steps, args.overrides)
    show(args.show or args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
