"""The CUDA caching allocator's peaks against the plan's GPU tier, step by step: a GPT-2 whose
blocks are all checkpointed (recomputed in backward), part of it streamed through a GPU tier of
``--gpu-memory``, under ``32-true`` and then ``bf16-mixed``, with the parameters placed again
(a new engine, as a dynamic-padding growth makes one) after ``--replace-after`` steps;
``--policy default`` runs the default policy instead (its profiled steps, then its plan).

    python tools/gpu_memory.py                          # 12 layers x 1024, batch 8 x 1024, gpu_memory 1GiB

One row per step as it ends: the allocator's allocated bytes at the step's start, its peak
allocated and peak reserved bytes in the step, the engine's GPU tier arena, the plan's count of
the tier (the parameters as placed, with their gradients and optimizer states there; the
activations kept and the backward's gradients as planned), ``gpu_memory``, and the
peak over each; a line at each re-placement with the allocated bytes before and after it (the
old engine's arena freed before the new one's is allocated: no rise). The last line sums up
both precisions. What lies outside every plan (cuBLAS's workspaces, 66 MiB on an H200) is in
``tools/cuda_reserve.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.gpu_parts import add_device_argument, exit_without_cuda

if __name__ == "__main__":
    exit_without_cuda("memory", sys.argv[1:])  # before the imports below: one line and exit 2 without a GPU

import argparse
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import lightning as L
import torch

from offload_strategy import TieredStrategy, format_bytes, parse_size
from offload_strategy.demos import gpt2_config
from tools.common import StepTimer, add_run_arguments, fit

PRECISIONS = ("32-true", "bf16-mixed")
# every block checkpointed, the first units resident as far as the tier allows (a layout the user
# fixes); or the default policy: the profiled steps, then the search and the layout they plan
POLICIES: dict[str, Union[str, dict[str, str]]] = {"checkpoint": {"name": "auto", "placement": "fill", "activations": "checkpoint"}, "default": "auto"}


def _allocated(cuda: bool) -> Optional[int]:
    return torch.cuda.memory_allocated() if cuda else None


def _size(n: Optional[int]) -> str:
    return "-" if n is None else format_bytes(n)


def _over(a: Optional[int], b: int) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def tier_count(trainer: L.Trainer) -> tuple[int, int]:
    """The GPU tier as the plan counts it after a step (``tools/tier_use.py``'s sum): the
    parameters as placed (with their gradients and optimizer states there), and the activations
    the forward kept (checkpointed blocks: their inputs) with the backward's gradients as planned."""
    activations = trainer.strategy.tiered.activations
    saved = int(trainer.strategy.metrics(reset=False).get("activations/saved_bytes", 0))
    return activations.gpu_parameter_bytes(), saved + activations.beside.gradients


@dataclass
class Row:
    step: int
    start: Optional[int]  # the allocator's figures: None without CUDA
    peak: Optional[int]
    reserved: Optional[int]
    arena: int
    parameters: int
    activations: int
    budget: int

    @property
    def plan(self) -> int:
        return self.parameters + self.activations


@dataclass
class MemoryRows(L.Callback):
    """Each step's row, printed as it ends; the re-placement after step ``replace_after``."""

    precision: str
    cuda: bool
    replace_after: int
    rows: list[Row] = field(default_factory=list)
    replaced: tuple[Optional[int], Optional[int]] = (None, None)  # allocated before and after the re-placement
    _start: Optional[int] = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._start = _allocated(self.cuda)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        core = trainer.strategy.tiered
        if self.cuda:
            torch.cuda.synchronize()
        row = Row(trainer.global_step, self._start, torch.cuda.max_memory_allocated() if self.cuda else None,
                  torch.cuda.max_memory_reserved() if self.cuda else None, core.engine.device.allocated if core.engine is not None else 0,
                  *tier_count(trainer), core.context.budgets.gpu)
        self.rows.append(row)
        print(f"| {self.precision} | {row.step} | {_size(row.start)} | {_size(row.peak)} | {_size(row.reserved)} | {format_bytes(row.arena)} | "
              f"{format_bytes(row.parameters)} | {format_bytes(row.activations)} | {format_bytes(row.plan)} | {format_bytes(row.budget)} | "
              f"{_over(row.peak, row.plan)} | {_over(row.peak, row.budget)} |", flush=True)
        if trainer.global_step == self.replace_after:
            before = _allocated(self.cuda)
            # as a growth of the batch's shapes does, in the share the plan in use gives the parameters
            # (beside the fixed layout's measured peak)
            in_use = core.session.in_use
            share = in_use.gpu_for_parameters if in_use is not None else core.context.budgets.gpu
            core._replace_engine(core.recipe(trainer), gpu_bytes=share)
            self.replaced = (before, _allocated(self.cuda))
            print(f"| {self.precision} | placed again | {_size(before)} -> {_size(self.replaced[1])} allocated | | | | | | | | | |", flush=True)


def run(precision: str, args: argparse.Namespace, root: str) -> MemoryRows:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()  # the other precision's cache gone: each run's reserved bytes its own
    rows = MemoryRows(precision, cuda, args.replace_after)
    strategy = TieredStrategy(gpu_memory=parse_size(args.gpu_memory, "--gpu-memory"), policy=POLICIES[args.policy])
    fit(strategy, gpt2_config(args.layers, args.width, positions=args.seq_len), args, Path(root) / precision, StepTimer(), args.steps,
        precision=precision, callbacks=[rows])
    return rows


def summary(precision: str, rows: MemoryRows) -> str:
    peak = max((r.peak for r in rows.rows if r.peak is not None), default=None)
    reserved = max((r.reserved for r in rows.rows if r.reserved is not None), default=None)
    last = rows.rows[-1]
    before, after = rows.replaced
    return (f"{precision} peak {_size(peak)} allocated ({_over(peak, last.plan)} of the plan's {format_bytes(last.plan)}, {_over(peak, last.budget)} "
            f"of gpu_memory), {_size(reserved)} reserved; placed again: {_size(before)} -> {_size(after)} allocated")


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, layers=12, width=1024, seq_len=1024, batch_size=8, steps=6, warmup=0)
    parser.add_argument("--gpu-memory", default="1GiB", help="the GPU tier")
    parser.add_argument("--replace-after", type=int, default=3, help="steps before the parameters are placed again")
    parser.add_argument("--precision", nargs="+", default=list(PRECISIONS))
    parser.add_argument("--policy", choices=list(POLICIES), default="checkpoint",
                        help="checkpoint: every block checkpointed, placement fill; default: the strategy's default policy")
    add_device_argument(parser)
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    args.accelerator = "gpu" if args.device == "cuda" else "cpu"
    layout = "every block checkpointed" if args.policy == "checkpoint" else "the default policy"
    print(f"GPT-2 {args.layers} layers x {args.width} wide, batch {args.batch_size} x {args.seq_len}, {layout}, gpu_memory "
          f"{args.gpu_memory}, placed again after step {args.replace_after}, on {args.device}\n")
    print("| precision | step | allocated at its start | peak allocated | peak reserved | engine's arena | plan: parameters as placed "
          "| plan: activations kept, backward's gradients | plan | gpu_memory | peak / plan | peak / gpu_memory |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    lines = []
    with tempfile.TemporaryDirectory() as root:
        for precision in args.precision:
            lines.append(summary(precision, run(precision, args, root)))
    print("memory: " + "; ".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
