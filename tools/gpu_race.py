"""A race between the host and CUDA's queues, looked for bitwise: ``zero_infinity`` (every unit on
NVMe, through a few pinned staging slots) trains a stack of wide linear blocks, every other one
frozen (a LoRA base's case: no gradient event orders anything for those units), for a few steps
of a batch large enough that the GPU's queue runs far behind the host; then the same run again
in a child process under ``CUDA_LAUNCH_BLOCKING=1``, where every kernel and copy ends before the
host goes on. A missing host wait (a staging slot released and refilled while its copy into the
GPU tier is still queued) changes the first run's numbers and not the second's.

    python tools/gpu_race.py --nvme-path /mnt/nvme          # 8 blocks of 105 MB, batch 32768, 3 steps

Prints each run's losses as it ends, then one line: the verdict, and the first difference (the
first step whose loss differs, the first tensor whose final values differ and by how much).
Exits 0 when both runs are the same bits, 1 when they differ. Both runs are fp32, with cuBLAS's
deterministic workspace (``CUBLAS_WORKSPACE_CONFIG``), so that only a race can tell them apart.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.gpu_parts import add_device_argument, exit_without_cuda

if __name__ == "__main__":
    exit_without_cuda("race", sys.argv[1:])  # before the imports below: one line and exit 2 without a GPU

import argparse
import os
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: the same reduction order in both runs
warnings.filterwarnings("ignore")

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from offload_strategy import TieredStrategy, format_bytes
from offload_strategy.hardware.device import RACE_CHECK_ENV
from tests.helpers import LossRecorder

BLOCKING = "CUDA_LAUNCH_BLOCKING"


class Blocks(L.LightningModule):
    """Linear blocks with GELU between them, each one unit; the even ones frozen. Each step's input
    and target are drawn on the device from the step's index (no host data to copy)."""

    def __init__(self, blocks: int, width: int, batch: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        for block in self.blocks[::2]:  # block 2, 4, ...: backward passes through them to the trainable ones before
            block.requires_grad_(False)
        self.width, self.batch = width, batch

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        device = batch.device  # the root device, where Lightning put the batch (the parameters' homes may lie elsewhere)
        generator = torch.Generator(device=device).manual_seed(1000 + batch_idx)
        x = torch.randn(self.batch, self.width, generator=generator, device=device)
        target = torch.randn(self.batch, self.width, generator=generator, device=device)
        for block in self.blocks:
            x = F.gelu(block(x))
        return F.mse_loss(x, target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class Homes(L.Callback):
    """Where the units were in the last step (gpu/host/nvme), and whether the emulated device kept
    the race check's books."""

    def __init__(self) -> None:
        self.homes, self.race_checked = "-", False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        m = trainer.strategy.metrics()
        self.homes = "/".join(str(int(m.get(f"units/{tier}", 0))) for tier in ("gpu", "host", "nvme"))
        self.race_checked = getattr(trainer.strategy.engine.device, "race_check", None) is not None


@dataclass
class Run:
    losses: list[float]
    weights: dict[str, torch.Tensor]
    homes: str
    seconds: float
    race_checked: bool = False


def train(args: argparse.Namespace) -> Run:
    """The run, the same in both processes: seed 0, fp32, ``zero_infinity`` under ``--nvme-path``."""
    start = time.perf_counter()
    L.seed_everything(0, verbose=False)
    model = Blocks(args.blocks, args.width, args.batch)
    losses, homes = LossRecorder(), Homes()
    with tempfile.TemporaryDirectory(dir=args.nvme_path, prefix="race-nvme-") as nvme, tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(strategy=TieredStrategy(policy="zero_infinity", nvme_path=nvme), accelerator="gpu" if args.device == "cuda" else "cpu",
                            devices=1, max_steps=args.steps, precision="32-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, callbacks=[losses, homes], default_root_dir=root)
        trainer.fit(model, DataLoader(list(range(args.steps)), batch_size=1))
        weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}  # read while the NVMe files exist
    return Run(losses.losses, weights, homes.homes, time.perf_counter() - start, homes.race_checked)


def first_difference(ours: Run, blocking: Run) -> Optional[str]:
    """The first step whose loss differs, then the first tensor whose final values differ; None
    when every loss and every weight is the same bits."""
    for step, (a, b) in enumerate(zip(ours.losses, blocking.losses), 1):
        if a != b:
            return f"step {step}'s loss {a!r} against {b!r} with launch blocking"
    if len(ours.losses) != len(blocking.losses):
        return f"{len(ours.losses)} losses against {len(blocking.losses)} with launch blocking"
    for name, value in ours.weights.items():
        other = blocking.weights.get(name)
        if other is None or not torch.equal(value, other):
            diff = "missing" if other is None else f"max |diff| {(value.double() - other.double()).abs().max().item():.3g}"
            return f"final {name}: {diff}"
    return None


def blocking_run(args: argparse.Namespace, argv: list[str]) -> Run:
    """This script again, in a child process under CUDA_LAUNCH_BLOCKING=1 (read when CUDA starts,
    so it cannot be turned on in this process), its run saved to a file."""
    env = {k: v for k, v in os.environ.items() if k != RACE_CHECK_ENV}
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "run.pt"
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--child", str(out)], env={**env, BLOCKING: "1"},
                              capture_output=True, text=True, timeout=args.child_timeout)
        if done.returncode != 0 or not out.is_file():
            raise SystemExit(f"race: the run under {BLOCKING}=1 failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        saved = torch.load(out, weights_only=True)
    return Run(saved["losses"], saved["weights"], saved["homes"], saved["seconds"])


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=5120, help="each block's unit holds width x (width + 1) fp32 values (5120: 105 MB)")
    parser.add_argument("--batch", type=int, default=32768, help="rows per step: each block's forward about as long as its read from NVMe")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nvme-path", default=None, help="directory for the NVMe tier (default: the temporary directory)")
    parser.add_argument("--child-timeout", type=int, default=200, help="seconds the run under launch blocking may take")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the run under launch blocking: where it saves itself
    add_device_argument(parser)
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.child is not None:
        run = train(args)
        torch.save({"losses": run.losses, "weights": run.weights, "homes": run.homes, "seconds": run.seconds}, args.child)
        return 0
    if args.device == "cpu":  # the emulated device's copies land late, as CUDA's may, and a host access before its wait raises
        os.environ[RACE_CHECK_ENV] = "1"
    ours = train(args)
    checked = ", under the emulated device's race check" if ours.race_checked else ""
    print(f"asynchronous: losses {ours.losses} in {ours.seconds:.0f} s, units gpu/host/nvme {ours.homes}{checked}", flush=True)
    blocking = blocking_run(args, argv)
    print(f"{BLOCKING}=1: losses {blocking.losses} in {blocking.seconds:.0f} s", flush=True)
    unit = args.width * (args.width + 1) * 4
    what = (f"zero_infinity, {args.blocks} blocks of {format_bytes(unit)} ({(args.blocks + 1) // 2} frozen), batch {args.batch} x {args.width}, "
            f"{args.steps} steps, units gpu/host/nvme {ours.homes}, on {args.device}")
    difference = first_difference(ours, blocking)
    if difference is None:
        print(f"race: none seen: {len(ours.losses)} losses and {len(ours.weights)} tensors the same bits as under {BLOCKING}=1 ({what})")
        return 0
    print(f"race: DIFFERS from the run under {BLOCKING}=1: first {difference} ({what})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
