"""Kill a training run with SIGKILL at a random step, resume it from its last checkpoint, and compare
the final weights with a run that was never interrupted.

    python tools/crash_resume.py --epochs 5 --steps-per-epoch 200

The model trains with parameters and optimizer states on host memory and NVMe, checkpointing at the
end of every epoch. The killed run leaves its NVMe directory behind; the resumed run must remove it,
resume from the last complete checkpoint (a kill during a save leaves the previous one whole), and
finish with exactly the weights of the uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def run(work: Path, nvme: Path, epochs: int, steps_per_epoch: int, kill_at: int, resume: bool, out: Path) -> None:
    """One training process: ``kill_at`` > 0 SIGKILLs itself after that many steps."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from offload_strategy import TieredStrategy
    from offload_strategy.demos import PARAMETERS_ONLY, CausalLM, SyntheticTokens

    class Kill(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if kill_at and trainer.global_step >= kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    config = dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  bos_token_id=None, eos_token_id=None)
    L.seed_everything(0, verbose=False)
    model = CausalLM(family="gpt2", config=config, lr=1e-3, warmup_steps=10)
    model.configure_model()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.model = None  # rebuilt by configure_model in fit, from the same seed
    L.seed_everything(0, verbose=False)
    seq, batch = 32, 4
    data = SyntheticTokens(seq_len=seq, batch_size=batch, num_tokens=int(steps_per_epoch * seq * batch / 0.95) + seq, seed=0, shuffle_seed=0)
    checkpoints = work / "checkpoints"
    strategy = TieredStrategy(gpu_memory=int(0.3 * total), host_memory=int(3.5 * total), nvme_path=nvme, nvme_memory="1GiB", policy=PARAMETERS_ONLY)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=work,
                        callbacks=[ModelCheckpoint(dirpath=checkpoints, filename="{epoch}", save_top_k=-1, every_n_epochs=1), Kill()])
    last = None
    if resume:
        saved = sorted(checkpoints.glob("epoch=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
        last = saved[-1] if saved else None
    trainer.fit(model, datamodule=data, ckpt_path=last)
    torch.save({"weights": model.state_dict(), "resumed_from": str(last), "removed_stale": [str(p) for p in strategy.removed_stale_nvme]}, out)


def child(args: argparse.Namespace, work: Path, nvme: Path, kill_at: int, resume: bool, out: Path) -> int:
    command = [sys.executable, __file__, "--child", str(work), str(nvme), str(kill_at), str(int(resume)), str(out),
               "--epochs", str(args.epochs), "--steps-per-epoch", str(args.steps_per_epoch)]
    return subprocess.run(command, capture_output=True, text=True, timeout=3600).returncode


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps-per-epoch", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="chooses the step at which the run is killed")
    parser.add_argument("--child", nargs=5, metavar=("WORK", "NVME", "KILL_AT", "RESUME", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        work, nvme, kill_at, resume, out = args.child
        run(Path(work), Path(nvme), args.epochs, args.steps_per_epoch, int(kill_at), bool(int(resume)), Path(out))
        return 0

    import torch

    total_steps = args.epochs * args.steps_per_epoch
    kill_at = random.Random(args.seed).randint(args.steps_per_epoch + 1, total_steps - 1)
    with tempfile.TemporaryDirectory(dir=".", prefix="crash-resume-") as tmp:
        tmp = Path(tmp)
        code = child(args, tmp / "straight", tmp / "nvme-straight", 0, False, tmp / "straight.pt")
        assert code == 0, f"the uninterrupted run failed ({code})"
        code = child(args, tmp / "crashed", tmp / "nvme", kill_at, False, tmp / "never.pt")
        left = [p.name for p in (tmp / "nvme").iterdir()]
        code_resumed = child(args, tmp / "crashed", tmp / "nvme", 0, True, tmp / "resumed.pt")
        straight = torch.load(tmp / "straight.pt", weights_only=True)
        resumed = torch.load(tmp / "resumed.pt", weights_only=True)
        diff = max((straight["weights"][k] - resumed["weights"][k]).abs().max().item() for k in straight["weights"])
        after = [p.name for p in (tmp / "nvme").iterdir()]

    print(f"\n{args.epochs} epochs of {args.steps_per_epoch} steps, parameters and Adam states partly on NVMe, a checkpoint per epoch\n")
    print("| what | result |\n|---|---|")
    print(f"| killed with SIGKILL at step | {kill_at} (exit code {code}) |")
    print(f"| NVMe directories left by the killed run | {len(left)} |")
    print(f"| resumed from | {Path(resumed['resumed_from']).name} (exit code {code_resumed}) |")
    print(f"| stale directories the resumed run removed | {len(resumed['removed_stale'])} |")
    print(f"| NVMe directories after the resumed run | {len(after)} |")
    print(f"| max abs difference of final weights vs uninterrupted run | {diff:.3g} |")
    ok = code == -signal.SIGKILL and code_resumed == 0 and diff == 0.0 and len(left) == 1 and not after and len(resumed["removed_stale"]) == 1
    print("\nidentical" if ok else "\nDIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
