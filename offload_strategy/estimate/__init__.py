"""Estimates before any run, from shapes on the meta device: every policy preset's least budgets
(``budgets.py``, :func:`estimate`) and the step model's what-ifs for a machine that may not be at
hand (``simulate.py``)."""

from .budgets import PRECISIONS, Estimate, PresetEstimate, estimate

__all__ = ["PRECISIONS", "Estimate", "PresetEstimate", "estimate"]
