"""The ``offload-strategy`` command.

    offload-strategy estimate path/to/config.json --batch-size 8 --seq-len 2048 --hardware rtx4090
    offload-strategy simulate path/to/config.json --hardware rtx4090 --gpu-memory 8GiB 16GiB --nvme-memory 1TB
    offload-strategy plan --from-shapes --out plan.json path/to/config.json --hardware rtx4090 --gpu-memory 8GiB
    offload-strategy plan --show plan.json
    offload-strategy probe --path /mnt/nvme/offload --size 1GiB
    offload-strategy consolidate epoch=3-step=400.ckpt model.ckpt
    offload-strategy report --nvme-path /mnt/nvme

``estimate`` prints the least ``gpu_memory``, ``host_memory`` and ``nvme_memory`` each policy preset
needs for a model and its predicted step (:func:`offload_strategy.estimate`); ``simulate`` the step
model's what-ifs for a machine that may not be at hand (``estimate/simulate.py``); ``plan`` makes
a plan file ``TieredStrategy(plan_file=...)`` runs, or prints one (``estimate/plans.py``). Their
model is a Hugging Face ``config.json`` (built on the meta device, nothing allocated or fetched),
or, in a checkout of the repository with the ``experiments`` extra, its Hydra job (``model=llama_7b
hardware=rtx4090 ...``; ``estimate/models.py``). ``probe`` measures this machine's transfer paths
and the NVMe store against the raw disk (``memory/bandwidth.py``); ``consolidate`` converts a
sharded checkpoint to the single file plain Lightning writes, and back (``checkpoint/consolidate.py``);
``report`` checks the environment: torch, CUDA, pinned registration, O_DIRECT on the NVMe path, free
memory per tier, cgroup limits. Also ``python -m offload_strategy``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from .config import PRESETS, format_bytes
from .estimate import PRECISIONS, Estimate, estimate
from .checkpoint import consolidate
from .estimate import plans, simulate
from .estimate.models import causal_lm, compose, instantiate, model_source
from .memory import bandwidth


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line ``argv`` (``sys.argv[1:]`` by default); returns the exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs: nothing is fetched
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # Hydra overrides after the options (``--findings data.seq_len=1024``) join the model's
        if not hasattr(args, "model") or not isinstance(args.model, list) or any(item.startswith("-") or "=" not in item for item in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.model = [*args.model, *extra]
    if args.command is None:
        parser.print_help()
        return 2
    command: Callable[[argparse.Namespace], int] = args.run
    return command(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload-strategy", description="Budgets, what-ifs and plans before a run; this machine's checks; checkpoints.")
    commands = parser.add_subparsers(dest="command")
    est = commands.add_parser("estimate", help="the least budgets of every policy preset for a model, and its predicted step")
    est.add_argument("model", help="a Hugging Face config.json (or its directory), or a model config of conf/model/ by name (llama_70b)")
    est.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: the Hydra data config's, else 1)")
    est.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the Hydra data config's, else 2048)")
    est.add_argument("--precision", default="bf16-true", choices=PRECISIONS)
    est.add_argument("--policy", nargs="*", default=None, choices=list(PRESETS), help="presets to estimate (default: all)")
    est.add_argument("--hardware", default="auto", help="a known machine (rtx4090, h100_80g, ...) or auto: this one")
    est.add_argument("--efficiency", type=float, default=0.5, help="share of the GPU's dense peak matrix products reach")
    est.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    est.set_defaults(run=_estimate)
    simulated = commands.add_parser("simulate", help="the step model's what-ifs: step time, memory per tier, the largest model, for GPU budgets")
    simulate.add_arguments(simulated)
    simulated.set_defaults(run=simulate.run)
    planned = commands.add_parser("plan", help="make a plan file (from a job's first steps, or from shapes), or print one")
    plans.add_arguments(planned)
    planned.set_defaults(run=plans.run)
    probe = commands.add_parser("probe", help="measure this machine's transfer paths, and the NVMe store against the raw disk")
    bandwidth.add_arguments(probe)
    probe.set_defaults(run=_probe)
    converted = commands.add_parser("consolidate", help="a sharded checkpoint directory to the single file plain Lightning writes, and back")
    consolidate.add_arguments(converted)
    converted.set_defaults(run=consolidate.run)
    report = commands.add_parser("report", help="check this machine: torch, CUDA, pinned memory, O_DIRECT, free memory, cgroup limits")
    report.add_argument("--nvme-path", default=None, help="the directory the NVMe tier would use")
    report.set_defaults(run=_report)
    return parser


# -- estimate ------------------------------------------------------------------------------------------


def _estimate(args: argparse.Namespace) -> int:
    model, batch = _model_and_batch(args.model, args.batch_size, args.seq_len)
    result = estimate(model, batch, precision=args.precision, policy=args.policy, hardware=args.hardware, efficiency=args.efficiency)
    print(json.dumps(_rows(result), indent=2) if args.json else result)
    return 0


def _rows(result: Estimate) -> dict[str, Any]:
    return {name: {"gpu_memory": row.gpu_memory, "host_memory": row.host_memory, "nvme_memory": row.nvme_memory,
                   "step_seconds": row.step_seconds, "units": row.units, "note": row.note} for name, row in result.items()}


def _model_and_batch(name: str, batch_size: Optional[int], seq_len: Optional[int]) -> tuple[nn.Module, Any]:
    """The model on the meta device and one batch of token ids, from a config file or a Hydra name."""
    source = model_source([name])
    if source.path is not None:
        return causal_lm(source.path), torch.zeros(batch_size or 1, seq_len or 2048, dtype=torch.long)
    cfg = compose([*source.overrides, "data=synthetic"])
    module = instantiate(cfg.model)  # its layers are built by configure_model, on the meta device by the estimate
    rows, tokens = batch_size or int(cfg.data.batch_size), seq_len or int(cfg.data.seq_len)
    return module, torch.zeros(rows, tokens, dtype=torch.long)


def _probe(args: argparse.Namespace) -> int:
    from .estimate.analytic import GPU_MEMORY_SHARE

    return bandwidth.run(args, priced_share=GPU_MEMORY_SHARE)


# -- report ----------------------------------------------------------------------------------------------


def _report(args: argparse.Namespace) -> int:
    for name, value in environment_report(args.nvme_path):
        print(f"{name:<28} {value}")
    return 0


def environment_report(nvme_path: Optional[str] = None) -> list[tuple[str, str]]:
    """What this machine offers the strategy, line by line (name, value)."""
    from .hardware import host_available

    lines = [("torch", torch.__version__), ("python", sys.version.split()[0]), ("CUDA available", _cuda())]
    lines.append(("pinned registration", _pinned()))
    lines.append(("host memory available", format_bytes(host_available())))
    lines.append(("GPU memory free", _gpu_free()))
    lines += _nvme_lines(nvme_path)
    lines += _cgroup_lines(Path("/sys/fs/cgroup"))
    return lines


def _cuda() -> str:
    if not torch.cuda.is_available():
        return "no (the GPU tier is emulated in host memory)"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return f"yes, CUDA {torch.version.cuda}: {names}"


def _pinned() -> str:
    """Whether host memory can be registered with CUDA, as the host tier registers it."""
    if not torch.cuda.is_available():
        return "not applicable (no CUDA)"
    from .memory.slab import HostSlab

    try:
        with HostSlab(1 << 21, pin=True):
            return "yes (cudaHostRegister of 2 MiB)"
    except (RuntimeError, MemoryError) as error:
        return f"no: {error}"


def _gpu_free() -> str:
    if not torch.cuda.is_available():
        return "n/a"
    from .hardware import gpu_free

    return ", ".join(f"cuda:{i} {format_bytes(gpu_free(torch.device('cuda', i)))}" for i in range(torch.cuda.device_count()))


def _nvme_lines(path: Optional[str]) -> list[tuple[str, str]]:
    if path is None:
        return [("NVMe path", "none given (--nvme-path DIR checks O_DIRECT and free space there)")]
    from .hardware import disk_free
    from .memory.nvme import _direct_works

    directory = Path(path).expanduser()
    if not directory.is_dir():
        return [("NVMe path", f"{directory}: not a directory")]
    held = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        works = _direct_works(held)
    finally:
        os.close(held)
    direct = "yes" if works else "no (tmpfs or a file system without it: buffered I/O, which fills the page cache)"
    return [("NVMe path", str(directory)), ("O_DIRECT", direct), ("NVMe free", format_bytes(disk_free(str(directory))))]


def _cgroup_lines(root: Path) -> list[tuple[str, str]]:
    """The cgroup (v2) limits of this process where readable: memory, swap, CPUs, locked memory."""
    group = _own_cgroup(root)
    lines = []
    for name, file in (("cgroup memory.max", "memory.max"), ("cgroup memory.current", "memory.current"), ("cgroup cpu.max", "cpu.max")):
        value = _read(group / file)
        if value is not None:
            lines.append((name, _bytes_or_raw(value) if file.startswith("memory") else value))
    if not lines:
        lines.append(("cgroup limits", f"not readable under {root}"))
    return lines


def _own_cgroup(root: Path) -> Path:
    text = _read(Path("/proc/self/cgroup")) or ""
    for line in text.splitlines():
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return root


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _bytes_or_raw(value: str) -> str:
    return format_bytes(int(value)) if value.isdigit() else value


if __name__ == "__main__":
    sys.exit(main())
