"""A logger that keeps what is logged in memory: the demo job's summary and the tests read it."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override


class MetricsRecorder(Logger):
    """Keeps every logged metric in memory, so the summary does not depend on the chosen logger.

    It answers with the name and version of ``mirror`` (the user's logger, if any), so Lightning,
    which joins the names and versions of all loggers into checkpoint paths and the progress bar,
    sees one run and not two.
    """

    def __init__(self, mirror: Optional[Logger] = None) -> None:
        super().__init__()
        self.mirror = mirror
        self.history: dict[str, list[tuple[int, float]]] = {}

    @property
    @override
    def name(self) -> Optional[str]:
        return self.mirror.name if self.mirror is not None else None

    @property
    @override
    def version(self) -> Optional[Any]:
        return self.mirror.version if self.mirror is not None else None

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        for key, value in metrics.items():
            self.history.setdefault(key, []).append((int(step or 0), float(value)))

    def last(self, key: str) -> Optional[float]:
        values = self.history.get(key)
        return values[-1][1] if values else None

    def first(self, key: str) -> Optional[float]:
        values = self.history.get(key)
        return values[0][1] if values else None
