"""What the GPU tier holds in each training step under the default policy: the parameters' share
of it (streaming buffers and resident units, as placed) and the activations the step's forward
kept there, against ``gpu_memory``, for a GPT-2 whose sequences change length from step to step
(dynamic padding: the first steps short, later ones long).

    python tools/tier_use.py --gpu-memory 2MiB --lengths 16,16,16,16,16,64,64,128,128,32

One row per step: the sequence length, the blocks' layout, the parameters' bytes, the activations
kept, the backward's gradients as planned (twice the largest tensor the forward saved), the
activation layout's planned peak (the blocks', what the forward keeps outside them and the
backward's gradients), the sum of parameters, activations kept and gradients over ``gpu_memory``;
on a GPU also the ``torch.cuda`` memory allocated before the step and the step's peak of it,
which show what the plan leaves out (cuBLAS's workspaces, the optimizer's states of GPU-tier
units, the allocator's rounding; ``tools/cuda_reserve.py`` takes the workspaces apart). On a machine without a GPU the tier is emulated in host memory
and nothing enforces it: a sum over 1.00 is what a GPU would have had to find room for beyond the
tier.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from offload_strategy.demos import CausalLM  # noqa: E402
from offload_strategy import TieredStrategy  # noqa: E402
from offload_strategy.config import parse_size  # noqa: E402


class Lengths(CausalLM):
    """A batch of token ids cut to this step's sequence length."""

    def __init__(self, lengths: list[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lengths = lengths

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch[:, : self.lengths[batch_idx % len(self.lengths)] + 1], batch_idx)


class TierRows(L.Callback):
    def __init__(self, budget: int) -> None:
        self.budget, self.rows, self.before = budget, [], None

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        tiered = trainer.strategy.tiered
        saved = int(trainer.strategy.metrics().get("activations/saved_bytes", 0))
        parameters = tiered.activations.gpu_parameter_bytes()
        layout = " ".join(str(p)[0].upper() for p in tiered.activations.policies)
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        plan = tiered.activations.plan
        planned = plan.peak_bytes if plan is not None else None
        gradients = tiered.activations.beside.gradients
        self.rows.append((module.lengths[batch_idx % len(module.lengths)], layout, parameters, saved, gradients, planned, peak, self.before))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-memory", default="2MiB")
    parser.add_argument("--lengths", default="16,16,16,16,16,64,64,128,128,32", help="each step's sequence length, in order")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    budget = parse_size(args.gpu_memory, "--gpu-memory")
    config = {"vocab_size": 512, "n_positions": max(lengths) + 1, "n_embd": args.width, "n_layer": args.layers, "n_head": 4,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (args.batch_size * len(lengths), max(lengths) + 1))
    rows = TierRows(budget)
    with tempfile.TemporaryDirectory() as root:
        L.Trainer(
            strategy=TieredStrategy(gpu_memory=budget, host_memory="4GiB"), accelerator="auto", devices=1, max_steps=len(lengths),
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
            callbacks=[rows],
        ).fit(Lengths(lengths, family="gpt2", config=config, lr=1e-3), DataLoader(tokens, batch_size=args.batch_size))
    print(f"\n| step | sequence | layout | parameters | activations kept | backward's gradients | planned peak | "
          f"sum / gpu_memory ({args.gpu_memory}) | CUDA memory before the step | its peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for step, (length, layout, parameters, saved, gradients, planned, peak, before) in enumerate(rows.rows, 1):
        cuda = f"{before / 2**20:.2f} MiB | {peak / 2**20:.2f} MiB" if peak is not None else "- | -"
        plan = f"{planned / 1024:.1f} KiB" if planned is not None else "-"
        print(f"| {step} | {length} | {layout} | {parameters / 1024:.1f} KiB | {saved / 1024:.1f} KiB | {gradients / 1024:.1f} KiB | {plan} | "
              f"{(parameters + saved + gradients) / budget:.2f} | {cuda} |")


if __name__ == "__main__":
    main()
