"""One training process of ``test_host_bound.py``: a GPT-2 built in ``configure_model`` under a
small host budget, every unit at home on NVMe; prints as JSON the anonymous resident set held
before ``fit``, its peak in each phase (``tools/largest.py``'s sampler), the budgets, and how
many parameters and optimizer states stayed on NVMe after ``fit``.

    python tests/host_bound_job.py WORKDIR --layers 6 --width 512 --host-memory 48MiB --gpu-memory 16MiB
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from offload_strategy import TieredStrategy  # noqa: E402
from offload_strategy.demos import CausalLM, SyntheticTokens, gpt2_config  # noqa: E402
from offload_strategy.hardware.resident import Phases, proc_status  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--host-memory", default="48MiB")
    parser.add_argument("--gpu-memory", default="16MiB")
    # kept blocks' activations count in the GPU tier: recomputed ones keep only their inputs there
    parser.add_argument("--activations", default="checkpoint")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one compute thread: fewer allocator arenas, the same on every machine
    phases = Phases()

    class Model(CausalLM):
        def configure_model(self) -> None:
            if self.model is None:
                phases.begin("construction")
                super().configure_model()
                phases.begin("setup")

    class Watch(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            phases.begin("steps")

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            phases.begin("teardown")

    L.seed_everything(0, verbose=False)
    module = Model(family="gpt2", config=gpt2_config(args.layers, args.width, positions=32), lr=1e-4)
    strategy = TieredStrategy(
        policy={"placement": "nvme", "activations": args.activations}, gpu_memory=args.gpu_memory, host_memory=args.host_memory,
        nvme_path=str(args.workdir / "nvme"),
    )
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[Watch()], default_root_dir=str(args.workdir),
    )
    data = SyntheticTokens(seq_len=32, batch_size=2, num_tokens=32 * 2 * (args.steps + 2) * 40)
    gc.collect()
    before = proc_status("RssAnon")
    trainer.fit(module, datamodule=data)
    phases.begin("after fit")
    gc.collect()
    phases.stop()
    state = trainer.optimizers[0].state
    print(json.dumps({
        "before": before, "peaks": {k: v for k, v in phases.anonymous.items() if k != "before fit"},
        "host": strategy.budgets.host, "gpu": strategy.budgets.gpu,
        "parameters": sum(p.numel() for p in module.parameters()),
        "deferred": len(strategy.deferred), "states_on_nvme": len(getattr(state, "pending", ())),
    }))


if __name__ == "__main__":
    main()
