"""One training process of ``test_beyond_host.py``: a GPT-2 built without memory, its weights
loaded from a sharded safetensors directory, trained with every unit at home on NVMe and sharded
checkpoints; prints the losses and the process's peak resident-set growth during ``fit`` as JSON.

    python tests/beyond_host_job.py WORKDIR --weights DIR [--resume CHECKPOINT] [--stop-after-epochs 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from offload_strategy.demos import CausalLM  # noqa: E402
from offload_strategy import TieredStrategy, load_weights  # noqa: E402
from tests.helpers import LossRecorder, StopAfterEpochs, tiny_data  # noqa: E402
from offload_strategy.hardware.resident import peak_rss, proc_status, reset_peak  # noqa: E402

CONFIG = {"n_layer": 16, "n_embd": 256, "n_head": 4, "n_positions": 64, "vocab_size": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
# the streaming buffers (2 MiB at least) beside the kept layout's 28.7 MiB of activations, counted in the GPU tier
GPU_MEMORY = 32 * 2**20
HOST_MEMORY = 28 * 2**20


class Pretrained(CausalLM):
    """A GPT-2 fine-tuned from a local directory: built in ``configure_model``, loaded there."""

    def __init__(self, weights: str) -> None:
        super().__init__(family="gpt2", config=CONFIG, lr=1e-2, warmup_steps=2)
        self.weights = weights

    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            load_weights(self.model, self.weights)


class PeakGrowth(L.Callback):
    """The resident set's high-water mark from just before the model is built to the end of
    training (its last checkpoint written; not the teardown, which brings the model back into
    host memory when it fits there, as plain training leaves it)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        reset_peak()
        self.before = proc_status("VmRSS")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.growth = peak_rss() - self.before


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--weights", type=Path, required=True, help="a Hugging Face directory of the model's weights")
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--stop-after-epochs", type=int)
    args = parser.parse_args()
    L.seed_everything(7, verbose=False)
    strategy = TieredStrategy(
        policy={"placement": "nvme", "activations": "keep"}, gpu_memory=GPU_MEMORY, host_memory=HOST_MEMORY,
        nvme_path=str(args.workdir / "nvme"), nvme_memory="2GiB", state_dict_type="sharded",
    )
    losses, peak = LossRecorder(), PeakGrowth()
    callbacks = [losses, peak, ModelCheckpoint(dirpath=args.workdir / "ckpt", save_top_k=-1, every_n_epochs=1, filename="{epoch}")]
    if args.stop_after_epochs:
        callbacks.append(StopAfterEpochs(args.stop_after_epochs))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=args.workdir, callbacks=callbacks,
    )
    trainer.fit(Pretrained(str(args.weights)), datamodule=tiny_data(), ckpt_path=args.resume)
    print(json.dumps({"losses": losses.losses, "peak_growth": peak.growth}))


if __name__ == "__main__":
    main()
