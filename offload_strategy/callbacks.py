"""``OffloadMonitor``: sends the strategy's metrics to every attached Lightning logger."""

from __future__ import annotations

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
    """

    def __init__(self, prefix: str = "offload/", every_n_steps: Optional[int] = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be a positive integer or None.")
        self.prefix = prefix
        self.every_n_steps = every_n_steps
        self.last: dict[str, float] = {}

    def _source(self, trainer: "pl.Trainer") -> Optional[Callable[[], dict[str, Any]]]:
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

    @override
    @rank_zero_only
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        interval = self.every_n_steps or trainer.log_every_n_steps
        if interval and trainer.global_step % interval == 0:
            metrics = self._collect(trainer)
            if metrics:
                self._publish(trainer, metrics)

    @override
    @rank_zero_only
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        metrics = self._collect(trainer)
        if metrics:
            self._publish(trainer, metrics)
