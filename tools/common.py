"""What the step-time tools share: the GPT-2 shapes they train, their arguments, a step timer, and
a short `fit` on random tokens from a fixed seed."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Sequence, Union

import lightning as L

from offload_strategy.demos import CausalLM, SyntheticTokens


def parameter_bytes(config: dict[str, Any]) -> int:
    model = CausalLM(family="gpt2", config=config)
    model.configure_model()
    return sum(p.numel() * p.element_size() for p in model.parameters())


def add_run_arguments(parser: argparse.ArgumentParser, *, layers: int, width: int, seq_len: int, batch_size: int, steps: int, warmup: int) -> None:
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup, help="steps of each run left out of the medians")


class StepTimer(L.Callback):
    """Wall time of every training step (forward, backward, optimizer step) and the strategy's metrics after it."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.metrics: list[dict[str, float]] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)
        metrics = getattr(trainer.strategy, "metrics", None)
        if callable(metrics):
            self.metrics.append(metrics())


def fit(
    strategy: Union[str, L.pytorch.strategies.Strategy],
    config: dict[str, Any],
    args: argparse.Namespace,
    root: Union[str, Path],
    timer: StepTimer,
    steps: int,
    precision: str = "32-true",
    devices: int = 1,
    callbacks: Sequence[L.Callback] = (),
) -> L.Trainer:
    """``steps`` steps of the GPT-2 ``config`` on random tokens, seed 0, on the CPU or, with
    ``args.accelerator="gpu"``, a GPU (``devices`` processes under a data-parallel strategy, each
    with its own batches); ``callbacks`` beside the timer."""
    L.seed_everything(0, verbose=False)
    model = CausalLM(family="gpt2", config=config, lr=1e-3)
    data = SyntheticTokens(seq_len=args.seq_len, batch_size=args.batch_size, num_tokens=args.seq_len * args.batch_size * (steps + 2) * 2 * devices)
    trainer = L.Trainer(strategy=strategy, accelerator=getattr(args, "accelerator", "cpu"), devices=devices, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[timer, *callbacks], default_root_dir=root, precision=precision)
    trainer.fit(model, datamodule=data)
    return trainer
