"""Make a plan for a configured job and write it to a file, or show a plan file.

    offload-strategy plan --from-shapes --out plan.json path/to/config.json --hardware rtx4090 --gpu-memory 8GiB
    offload-strategy plan --out plan.json                                  # the repository's default Hydra job
    offload-strategy plan --out plan.json model=gpt2_small strategy.gpu_memory=64MiB policy.activations=auto
    offload-strategy plan --from-shapes --out plan.json model=llama_7b hardware=rtx4090 trainer=gpu
    offload-strategy plan --show plan.json

Making a plan runs the job's first ``--steps`` training steps (the planner decides from what it
measures there: the first step records the order and, with ``policy.activations=auto``, profiles
the blocks; the warm steps after it price the plan, which the next step puts in place), then writes
every unit's home and every block's activation policy, with what they imply (each unit's compute
mode, where its gradient is produced, where its optimizer states live) and the step model's
predicted breakdown. ``TieredStrategy(plan_file="plan.json")`` (``strategy.plan_file=plan.json`` in a
Hydra job) runs the plan again without planning; edit the file to try another placement. Running a
job's steps needs the repository's Hydra job (the ``experiments`` extra, in a checkout).

``--from-shapes`` plans without running anything, for a model or a machine that is not at hand:
the model (a Hugging Face ``config.json``, or a Hydra job's) is built on the meta device (no
memory for its parameters, as ``simulate.py`` builds it), its units and blocks are costed from
their shapes and the ``hardware`` spec, and the default policy's joint search (resident units,
streaming buffers, block activation policies) runs within the job's budgets: ``--gpu-memory`` or
``strategy.gpu_memory`` (default: the spec's GPU memory), ``--host-memory`` or
``strategy.host_memory`` (default: 95% of the spec's host memory, what the strategy finds
available on an idle machine) and ``--nvme-memory`` or ``strategy.nvme_memory`` (default: none).
The budgets and every assumption are printed.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Budget, compute_dtype, format_bytes
from ..hardware import AVAILABLE_SHARE, resolve_hardware
from ..planning.auto import plan_auto
from ..planning.placement import GPU, PlacementError
from ..planning.plan_file import PlanFile, PlannedUnit, load_plan, prediction_record, save_plan
from .shapes import Pricing
from .models import ModelSource, compose, instantiate, model_source
from .simulate import Model, Shape, build, build_from_config, machine_of, parameter_links, unit_costs


def show(path: Path) -> None:
    """Print the plan file ``path``: every unit's home, mode, gradient and states; the blocks' layout; the prediction."""
    plan = load_plan(path)
    print(f"{path}: {len(plan.units)} units" + (f", budgets {', '.join(f'{k} {format_bytes(v)}' for k, v in plan.budgets.items())}" if plan.budgets else ""))
    print("\n| unit | name | bytes | home | mode | gradient | optimizer states |\n|---|---|---|---|---|---|---|")
    for index, unit in enumerate(plan.units):
        print(f"| {index} | {unit.name} | {format_bytes(unit.nbytes)} | {unit.home} | {unit.mode or '-'} | {unit.gradient or '-'} | {unit.states or '-'} |")
    totals: Counter[str] = Counter()
    for unit in plan.units:
        totals[unit.home] += unit.nbytes
    homes = (f"{home} {format_bytes(n)} ({sum(u.home == home for u in plan.units)} units)" for home, n in sorted(totals.items()))
    print("\nparameters by home: " + ", ".join(homes))
    if plan.activations is not None:
        counts = Counter(plan.activations)
        print(f"activations per block: {' '.join(plan.activations)} ({', '.join(f'{n} {p}' for p, n in sorted(counts.items()))})")
    p = plan.prediction
    if p:
        layout = f" + activation recomputes and swaps {p['layout_seconds'] * 1e3:.1f}" if p.get("layout_seconds") else ""
        print(f"predicted step (the step model): {p['step_seconds'] * 1e3:.1f} ms = forward "
              f"{p['forward_seconds'] * 1e3:.1f} + backward {p['backward_seconds'] * 1e3:.1f} + updates after backward "
              f"{p['update_tail_seconds'] * 1e3:.1f}" + layout
              + f"; {p['exposed_seconds'] * 1e3:.1f} ms of it transfers and updates not hidden "
              f"behind compute; {format_bytes(p['h2d_bytes'])} copied into the GPU tier")


def compose_job(overrides: Sequence[str], output_dir: Path) -> Any:
    """The job's configuration as ``experiments/train.py`` would run it in ``output_dir``: paths
    written ``${hydra:runtime.output_dir}/...`` (an experiment's ``strategy.nvme_path``) resolve there."""
    cfg = compose(overrides, hydra_config=True)  # refused here where Hydra or the configs are missing
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir.resolve())
    HydraConfig.instance().set_config(cfg)
    return cfg


def make(out: Path, steps: int, source: ModelSource) -> None:
    """The plan the job's first ``steps`` training steps make, written to ``out`` (a Hydra job's)."""
    if not source.hydra:
        raise SystemExit(f"{source.path}: a plan made by running needs the repository's Hydra job (its data and model); "
                         "for a config.json give --from-shapes, which runs nothing.")
    import lightning as L

    cfg = compose_job([*source.overrides, f"trainer.max_steps={steps}"], out.parent)
    try:
        from experiments.train import build_strategy
    except ImportError:
        raise SystemExit("a plan made by running trains the repository's Hydra job: install the experiments extra in a checkout "
                         "(pip install -e '.[experiments]'), or give --from-shapes.") from None
    L.seed_everything(cfg.seed)
    datamodule = instantiate(cfg.data)
    module = instantiate(cfg.model)
    strategy: Any = build_strategy(cfg, instantiate(cfg.hardware))
    if isinstance(strategy, str):
        raise SystemExit(f"strategy.name={strategy!r}: only the tiered strategy makes plans.")

    class Dump(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            strategy.dump_plan(out)

    trainer = instantiate(cfg.trainer, strategy=strategy, logger=False, callbacks=[Dump()], enable_checkpointing=False,
                          limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(out.parent))
    trainer.fit(module, datamodule=datamodule)


def shapes_budgets(cfg: Any, hardware: Any) -> tuple[int, int, int]:
    """The job's budgets against the hardware spec's sizes (see the module docstring)."""
    strategy = cfg.strategy
    return budgets_of(hardware, strategy.gpu_memory, strategy.host_memory, strategy.get("nvme_memory"),
                      names=("strategy.gpu_memory", "strategy.host_memory", "strategy.nvme_memory"))


def budgets_of(hardware: Any, gpu: Any, host: Any, nvme: Any, names: tuple[str, str, str] = ("--gpu-memory", "--host-memory", "--nvme-memory")
               ) -> tuple[int, int, int]:
    """GPU, host and NVMe budgets (bytes, sizes such as ``16GiB``, shares, or None: the defaults of
    the module docstring) against the hardware spec's sizes; ``names``: what a refusal calls them."""
    return (Budget.parse(gpu, names[0]).resolve(hardware.gpu_memory),
            Budget.parse(host, names[1]).resolve(int(AVAILABLE_SHARE * hardware.host_memory)),
            Budget.parse(nvme, names[2]).resolve(0))


def gradient_life(cfg: Any) -> dict[str, bool]:
    """How long offloaded units' gradients live in the job, as the strategy decides it from the
    recipe: each unit is updated as its gradients complete (after its reduction, under data
    parallelism); with clipping by norm or accumulation one process's wait on NVMe, and
    data-parallel ranks keep them at home."""
    trainer = cfg.trainer
    single = int(trainer.get("devices", 1) or 1) == 1 and cfg.strategy.name != "tiered_ddp"
    waits = bool(trainer.get("gradient_clip_val")) or int(trainer.get("accumulate_grad_batches", 1) or 1) > 1
    return {"gradients_until_update": single or not waits, "spill_gradients": single and waits}


@dataclass(frozen=True)
class ShapesJob:
    """What a plan from shapes is made for: the model's step model, the machine, the budgets
    (GPU, host, NVMe), the precision and how long offloaded gradients live."""

    model: Model
    hardware: Any
    budgets: tuple[int, int, int]
    precision: str
    gradients: dict[str, bool]


def shapes_job(args: argparse.Namespace, source: ModelSource, out: Path) -> ShapesJob:
    """The job the command line names, for a plan from shapes: a ``config.json`` with flags
    (one process, no clipping or accumulation), or a Hydra job."""
    if not source.hydra:
        assert source.path is not None
        hardware = resolve_hardware(args.hardware or "auto")
        precision = args.precision or "32-true"
        pricing = Pricing(hardware, dtype=compute_dtype(precision), efficiency=args.efficiency, half=precision in ("bf16-true", "16-true"),
                          mixed=precision.endswith("-mixed"))
        model = _priced(lambda: build_from_config(source.path, Shape(args.batch_size or 1, args.seq_len or 2048), pricing), precision)
        return ShapesJob(model, hardware, budgets_of(hardware, args.gpu_memory, args.host_memory, args.nvme_memory), precision,
                         {"gradients_until_update": True, "spill_gradients": False})
    cfg = compose_job(hydra_overrides(source, args), out.parent)
    if cfg.policy.get("chunk_size"):
        raise SystemExit("--from-shapes plans transfer units as the model defines them; leave policy.chunk_size unset.")
    hardware = instantiate(cfg.hardware)
    precision = str(cfg.trainer.get("precision", "32-true"))
    model = _priced(lambda: build(cfg, hardware, precision in ("bf16-true", "16-true"), args.efficiency, dtype=compute_dtype(precision),
                                  mixed=precision.endswith("-mixed")), precision)
    return ShapesJob(model, hardware, shapes_budgets(cfg, hardware), precision, gradient_life(cfg))


def hydra_overrides(source: ModelSource, args: argparse.Namespace) -> list[str]:
    """The Hydra job's overrides, the flags that name its groups, sizes and budgets among them."""
    flags = {"hardware": args.hardware, "data.batch_size": args.batch_size, "data.seq_len": args.seq_len, "trainer.precision": args.precision,
             "strategy.gpu_memory": args.gpu_memory, "strategy.host_memory": args.host_memory, "strategy.nvme_memory": args.nvme_memory}
    return [*source.overrides, *(f"{key}={value}" for key, value in flags.items() if value is not None)]


def _priced(build_model: Any, precision: str) -> Model:
    try:
        model: Model = build_model()
    except ValueError as error:  # a machine probed without a GPU has no peak to price compute at
        raise SystemExit(f"{error} --from-shapes prices compute from the spec: name a known machine (--hardware rtx4090, ...) "
                         f"or give its peak (+hardware.gpu_{compute_dtype(precision)}_tflops=... in a Hydra job).") from None
    return model


def make_from_shapes(out: Path, job: ShapesJob, efficiency: float) -> None:
    """The default policy's joint search on ``job``'s shapes, written to ``out`` as a plan file."""
    started = time.perf_counter()
    model, (gpu, host, nvme) = job.model, job.budgets
    machine = machine_of(job.hardware, nvme)
    owners = [0] * len(model.units)
    links = parameter_links(machine, sum(s.nbytes for s in model.sizes))
    try:
        plan = plan_auto(
            model.sizes, model.co_resident, [u.index for u in model.units], unit_costs(model, owners), machine, gpu_bytes=max(gpu - model.beside.in_blocks, 0),
            host_bytes=host, nvme_bytes=nvme, state_factor=model.state_factor, blocks=model.blocks, links=links, activation_host_bytes=host // 2,
            block_units=model.block_units, head=model.beside.head, gradients_until_update=job.gradients["gradients_until_update"],
            spill_gradients=job.gradients["spill_gradients"],
        )
    except PlacementError as error:
        raise SystemExit(f"offload-strategy plan --from-shapes: no plan within GPU {format_bytes(gpu)}, host {format_bytes(host)}, "
                         f"NVMe {format_bytes(nvme)}: {error}") from None
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
    hardware = job.hardware
    print(f"{model.name}: {model.parameters / 1e9:.2f} B parameters in {len(model.units)} units and {len(model.blocks)} blocks, {job.precision}, "
          f"{model.tokens:,} tokens per step, built on the meta device and planned in {time.perf_counter() - started:.1f} s")
    print(f"hardware {hardware.name} ({hardware.gpu}); budgets: GPU {format_bytes(gpu)}, host {format_bytes(host)}, NVMe {format_bytes(nvme)}; "
          f"compute priced at {efficiency:.0%} of the GPU's dense peak; the plan's step: {plan.seconds:.2f} s (step model, from shapes)\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` command's arguments (``offload-strategy plan``)."""
    from ..session.plans import TIMED_STEPS, WARM_UP_STEPS

    parser.add_argument("model", nargs="*", help="a Hugging Face config.json (or its directory), with --from-shapes; or, in a checkout with the "
                        "experiments extra, Hydra overrides of its job, as for experiments/train.py (a bare name: model=NAME)")
    parser.add_argument("--out", type=Path, help="where to write the plan")
    parser.add_argument("--show", type=Path, help="a plan file to print")
    # the plan is made between the last timed step and the next, and put in place as that one starts
    planned = WARM_UP_STEPS + TIMED_STEPS + 1
    parser.add_argument("--steps", type=int, default=planned, help=f"training steps to run before writing the plan (default {planned}: planning "
                        f"prices warm steps {WARM_UP_STEPS + 1} to {WARM_UP_STEPS + TIMED_STEPS}; fewer write the set-up placement)")
    parser.add_argument("--from-shapes", action="store_true", help="plan from the model's shapes and the hardware spec, running nothing")
    parser.add_argument("--efficiency", type=float, default=0.5, help="--from-shapes: model FLOPs utilisation of the GPU's dense peak")
    parser.add_argument("--hardware", default=None, help="a known machine (rtx4090, h100_80g, ...) or auto: this one (default: auto, or the Hydra job's)")
    parser.add_argument("--precision", default=None, help="32-true, bf16-mixed, bf16-true, ... (default: 32-true, or the Hydra job's)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: 1, or the Hydra job's)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 2048, or the Hydra job's)")
    for tier, default in (("gpu", "the spec's GPU memory"), ("host", "95%% of the spec's host memory"), ("nvme", "none")):
        parser.add_argument(f"--{tier}-memory", default=None, help=f"the {tier} budget: bytes, 16GiB or a share (default: {default}, or the Hydra job's)")


def run(args: argparse.Namespace) -> int:
    """``offload-strategy plan``: make a plan and print it, or print one."""
    if args.show is None and args.out is None:
        raise SystemExit("offload-strategy plan: give --out PLAN.json to make a plan, or --show PLAN.json to print one.")
    if args.out is not None:
        source = model_source(args.model)
        if args.from_shapes:
            make_from_shapes(args.out, shapes_job(args, source, args.out), args.efficiency)
        else:
            make(args.out, args.steps, source)
    show(args.show or args.out)
    return 0
