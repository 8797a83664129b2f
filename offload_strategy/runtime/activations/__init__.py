"""Activations: the per-block policies, swaps to host memory or NVMe, saved-bytes counts."""
