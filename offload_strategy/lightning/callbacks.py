"""``OffloadMonitor``: sends the strategy's metrics to every attached Lightning logger."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl


class OffloadMonitor(Callback):
    """Log what ``trainer.strategy.metrics()`` reports, namespaced ``offload/...``.

    Works with any strategy that has a ``metrics()`` method returning ``{name: number}`` and with
    any Lightning logger; strategies without one are ignored. Metrics are logged once per logged
    step (``Trainer(log_every_n_steps=...)``) and once more when training ends.

    Args:
        prefix: prepended to every metric name.
        every_n_steps: overrides the trainer's ``log_every_n_steps``.
        prog_bar: also show, after every step, the share of unit requests that found the unit in
            the GPU tier (``offload_hit``), the GPU tier's bytes in use in MiB (``gpu_tier_MiB``)
            and the optimizer time the step waited for after backward (``update_exposed_ms``) in
            the progress bar. Reading them does not start a new logging interval.
    """

    # progress-bar name: (metric, scale)
    PROGRESS_BAR = {"offload_hit": ("cache/hit_rate", 1.0), "gpu_tier_MiB": ("tier/gpu_bytes", 2.0**-20), "update_exposed_ms": ("optimizer/exposed_ms", 1.0)}

    def __init__(self, prefix: str = "offload/", every_n_steps: Optional[int] = None, prog_bar: bool = False) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be a positive integer or None.")
        self.prefix = prefix
        self.every_n_steps = every_n_steps
        self.prog_bar = bool(prog_bar)
        self.last: dict[str, float] = {}
        self._peeks = False  # the strategy's metrics() takes reset (set up in setup)

    def _source(self, trainer: "pl.Trainer") -> Optional[Callable[..., dict[str, Any]]]:  # metrics(), with reset where it peeks
        source = getattr(trainer.strategy, "metrics", None)
        return source if callable(source) else None

    def _collect(self, trainer: "pl.Trainer") -> dict[str, float]:
        source = self._source(trainer)
        if source is None:
            return {}
        self.last = {f"{self.prefix}{name}": float(value) for name, value in source().items()}
        return self.last

    def _publish(self, trainer: "pl.Trainer", metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _show_in_progress_bar(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        source = self._source(trainer)
        if source is None:
            return
        metrics = source(reset=False) if self._peeks else source()
        for name, (key, scale) in self.PROGRESS_BAR.items():
            if key in metrics:
                pl_module.log(name, float(metrics[key]) * scale, prog_bar=True, logger=False, on_step=True, on_epoch=False)

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        # asked once, not every step: whether the strategy's metrics() can be read without
        # starting a new interval (reset=False)
        source = self._source(trainer)
        try:
            self._peeks = source is not None and "reset" in inspect.signature(source).parameters
        except (TypeError, ValueError):
            self._peeks = False

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.prog_bar:  # every rank its own figures; the bar shows rank 0's
            self._show_in_progress_bar(trainer, pl_module)
        interval = self.every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning's logger connector, undeclared
        if trainer.is_global_zero and interval and trainer.global_step % interval == 0:
            metrics = self._collect(trainer)
            if metrics:
                self._publish(trainer, metrics)

    @override
    @rank_zero_only
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        metrics = self._collect(trainer)
        if metrics:
            self._publish(trainer, metrics)
