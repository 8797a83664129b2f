"""What one profiled training step measured."""

from .profile import StepProfile, hold_spikes, mean_timing, steady_timing

__all__ = ["StepProfile", "hold_spikes", "mean_timing", "steady_timing"]
