"""What one profiled training step measured."""

from .profile import StepProfile, fastest_timing, hold_spikes, mean_timing, steady_timing

__all__ = ["StepProfile", "fastest_timing", "hold_spikes", "mean_timing", "steady_timing"]
