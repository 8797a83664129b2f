"""A tiny language model and a way to train it with any strategy, for side-by-side tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Union

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from offload_strategy.demos import PARAMETERS_ONLY, CausalLM, SyntheticTokens  # noqa: F401 (the tests of parameter offloading take PARAMETERS_ONLY from here)

TINY_GPT2 = dict(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
BATCHES_PER_EPOCH = 6


class StopAfterEpochs(Callback):
    """Ends training after ``epochs`` epochs while the schedule still plans for more."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"].detach()))


def tiny_data(seed: int = 0) -> SyntheticTokens:
    seq_len, batch = 16, 4
    tokens = int(BATCHES_PER_EPOCH * batch * seq_len / 0.95) + seq_len  # 6 train batches + a val window
    return SyntheticTokens(seq_len=seq_len, batch_size=batch, vocab_size=256, num_tokens=tokens, seed=seed, shuffle_seed=seed)


def train(
    strategy: Union[str, L.pytorch.strategies.Strategy],
    root: Path,
    *,
    epochs: int = 2,
    stop_after_epochs: Optional[int] = None,
    resume: Optional[Path] = None,
    save_every_epoch: bool = False,
    precision: Optional[str] = "32-true",
    accelerator: str = "cpu",
    seed: int = 7,
    extra_callbacks: tuple[Callback, ...] = (),
    make_model: Optional[Callable[[], L.LightningModule]] = None,
    config: Optional[dict[str, Any]] = None,
    **trainer_kwargs: Any,
) -> tuple[list[float], dict[str, torch.Tensor], L.Trainer]:
    """Train the tiny model from ``seed``; return the per-step losses, final weights and trainer.

    ``make_model`` builds another model (after seeding) instead of the tiny GPT-2; ``config``
    replaces the GPT-2 config. ``stop_after_epochs`` interrupts a run of ``epochs`` epochs early, as a crash would, so that
    its learning-rate schedule is the one of the full run.
    """
    L.seed_everything(seed, verbose=False)
    model = make_model() if make_model else CausalLM(family="gpt2", config=config or TINY_GPT2, lr=1e-2, warmup_steps=2)
    recorder = LossRecorder()
    callbacks: list[Callback] = [recorder, *extra_callbacks]
    if stop_after_epochs is not None:
        callbacks.append(StopAfterEpochs(stop_after_epochs))
    if save_every_epoch:
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1, every_n_epochs=1, filename="{epoch}"))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=save_every_epoch,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=callbacks,
        **({"precision": precision} if precision is not None else {}),
        **trainer_kwargs,
    )
    trainer.fit(model, datamodule=tiny_data(), ckpt_path=resume)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return recorder.losses, weights, trainer


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs: max |diff| {(a[name] - b[name]).abs().max().item()}"
