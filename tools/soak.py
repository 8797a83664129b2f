"""Train many steps with parameters on NVMe and watch that nothing grows: resident memory, open
files and threads are sampled as training goes.

    python tools/soak.py --steps 1000
    python tools/soak.py --steps 2000 --checkpoint-every 200   # with checkpoints saved as it goes

Prints one row per sample and the spread after warm-up; exits non-zero if memory grew by more
than ``--rss-slack`` or open files or threads grew at all.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
import psutil  # noqa: E402

from offload_strategy import TieredStrategy, format_bytes  # noqa: E402
from offload_strategy.demos import PARAMETERS_ONLY, CausalLM, SyntheticTokens  # noqa: E402


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


class Sampler(L.Callback):
    def __init__(self, every: int, nvme: Path, checkpoints: Path) -> None:
        self.every = every
        self.nvme, self.checkpoints = nvme, checkpoints
        self.rows: list[tuple[int, int, int, int, float, float, int, int, float, float]] = []
        self.process = psutil.Process()
        self.homes = ""

    def on_train_batch_end(self, trainer, *args: Any) -> None:
        step = trainer.global_step
        if step % self.every == 0:
            metrics = trainer.strategy.metrics()
            self.homes = "/".join(str(int(metrics.get(f"units/{h}", 0))) for h in ("gpu", "host", "nvme"))
            self.rows.append((step, self.process.memory_info().rss, len(os.listdir("/proc/self/fd")), self.process.num_threads(),
                              metrics.get("link/nvme_read_bytes_total", 0.0), metrics.get("cache/hit_rate", float("nan")),
                              directory_bytes(self.nvme), directory_bytes(self.checkpoints),
                              metrics.get("tier/gpu_reserved_bytes", 0.0), metrics.get("tier/host_bytes", 0.0)))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=100, help="steps before the first sample that counts")
    parser.add_argument("--rss-slack", default="32MiB", help="allowed RSS growth after warm-up")
    parser.add_argument("--nvme-path", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save a checkpoint every this many steps (the last one kept)")
    args = parser.parse_args(argv)

    config = dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    L.seed_everything(0, verbose=False)
    model = CausalLM(family="gpt2", config=config, lr=1e-3)
    model.configure_model()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory(dir=args.nvme_path or ".", prefix="soak-nvme-") as nvme, tempfile.TemporaryDirectory(prefix="soak-ckpt-") as root:
        sampler = Sampler(args.every, Path(nvme), Path(root) / "ckpt")
        callbacks: list[L.Callback] = [sampler]
        if args.checkpoint_every:
            callbacks.append(ModelCheckpoint(dirpath=Path(root) / "ckpt", every_n_train_steps=args.checkpoint_every, save_top_k=1))
        strategy = TieredStrategy(gpu_memory=int(0.3 * param_bytes), host_memory=int(3.5 * param_bytes), nvme_path=nvme, nvme_memory="1GiB", policy=PARAMETERS_ONLY)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                            enable_checkpointing=bool(args.checkpoint_every), default_root_dir=root,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks)
        trainer.fit(model, datamodule=SyntheticTokens(seq_len=32, batch_size=4, num_tokens=200_000))
        leftover = list(Path(nvme).iterdir())

    print(f"\nGPT-2 4 x 64, {format_bytes(param_bytes)} of parameters, gpu_memory 30%, host_memory 3.5x the parameters "
          f"(units gpu/host/nvme: {sampler.homes}); {args.steps} steps, "
          f"{f'a checkpoint every {args.checkpoint_every} steps' if args.checkpoint_every else 'no checkpoints'}\n")
    print("| step | RSS | open files | threads (OS) | NVMe bytes read | hit rate (last window) | NVMe directory | checkpoint directory | GPU-tier arena | host tier in use |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for step, rss, fds, threads, read, hit, swap, ckpt, arena, host in sampler.rows:
        print(f"| {step} | {format_bytes(rss)} | {fds} | {threads} | {format_bytes(read)} | {hit:.1%} | {format_bytes(swap)} | {format_bytes(ckpt)} | "
              f"{format_bytes(int(arena))} | {format_bytes(int(host))} |")
    steady = [row for row in sampler.rows if row[0] >= args.warmup]
    rss_growth = max(r[1] for r in steady) - steady[0][1]
    fd_growth = max(r[2] for r in steady) - steady[0][2]
    thread_growth = max(r[3] for r in steady) - steady[0][3]
    swap_growth = max(r[6] for r in steady) - steady[0][6]
    tier_growth = max(r[8] + r[9] for r in steady) - (steady[0][8] + steady[0][9])
    slack = int(__import__("offload_strategy").parse_size(args.rss_slack))
    print(f"\nafter step {steady[0][0]}: RSS +{format_bytes(rss_growth)}, open files +{fd_growth}, threads +{thread_growth}, "
          f"NVMe directory +{format_bytes(swap_growth)}, GPU arena and host tier +{format_bytes(int(tier_growth))}; "
          f"files left in the NVMe directory after fit: {len(leftover)}")
    ok = rss_growth <= slack and fd_growth <= 0 and thread_growth <= 0 and swap_growth <= 0 and tier_growth <= 0 and not leftover
    print("flat" if ok else "GREW")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
