"""What one profiled training step measured."""

from .profile import StepProfile, mean_timing

__all__ = ["StepProfile", "mean_timing"]
