"""What one profiled training step measured."""

from .profile import StepProfile

__all__ = ["StepProfile"]
