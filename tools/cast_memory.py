"""How much a streamed forward grows the process under each precision: a deep MLP whose every
layer is at home in host memory and streamed through a GPU tier of a fifth of its weights, one
training step (the first: later ones reuse the memory the earlier freed); the resident set (and LiveBytes, the tensors the forward made
and holds) at the first layer's start and at the last one's, beside the fp32 weights' bytes.
Under ``*-mixed`` a forward that keeps 16-bit casts of the streamed weights grows by half of them.

    python tools/cast_memory.py --layers 48 --width 1024 --batch 2 --precision bf16-mixed 32-true
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from offload_strategy import TieredStrategy  # noqa: E402
from offload_strategy.config import format_bytes  # noqa: E402
from offload_strategy.estimate.live_bytes import LiveBytes  # noqa: E402


class DeepMLP(L.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
        self.growth: tuple[int, int] = (0, 0)  # resident set, LiveBytes

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        marks: list[tuple[int, int]] = []
        process = psutil.Process()
        hooks = [layer.register_forward_pre_hook(lambda *_: marks.append((process.memory_info().rss, live.bytes)))
                 for layer in (self.layers[0], self.layers[-1])]
        with LiveBytes() as live:
            out = self.layers(batch[0])
        for hook in hooks:
            hook.remove()
        if batch_idx == 0:  # the first forward: later ones find the memory the earlier freed in the allocator's heap
            self.growth = (marks[1][0] - marks[0][0], marks[1][1] - marks[0][1])
        return out.float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def measure(layers: int, width: int, batch: int, precision: str) -> tuple[int, int]:
    torch.manual_seed(0)
    weights = layers * width * width * 4
    model = DeepMLP(layers, width)
    strategy = TieredStrategy(gpu_memory=weights // 5, host_memory=3 * weights, policy={"name": "auto", "placement": "host", "activations": "keep"})
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, precision=precision, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(3 * batch, width)), batch_size=batch))
    return model.growth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--precision", nargs="+", default=["bf16-mixed", "32-true"])
    args = parser.parse_args()
    weights = args.layers * args.width * args.width * 4
    print(f"{args.layers} layers of {args.width}x{args.width}: {format_bytes(weights)} of fp32 weights, batch {args.batch}")
    print("| precision | forward's growth (resident set) | (LiveBytes) | of the fp32 weights |")
    print("|---|---|---|---|")
    for precision in args.precision:
        rss, live = measure(args.layers, args.width, args.batch, precision)
        print(f"| {precision} | {format_bytes(rss)} | {format_bytes(live)} | {live / weights:.3f} |")


if __name__ == "__main__":
    main()
