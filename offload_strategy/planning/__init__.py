"""Planning: pure functions from a profile and a machine to a plan. Nothing here imports torch,
so plans can be made, tested and simulated anywhere. The searches, in ``searches/``, are named after what they compute; each cites its paper."""

from .searches.buffer_counts import SizeClass, buffer_counts, size_classes, size_counts, tensor_size_distribution

__all__ = ["SizeClass", "buffer_counts", "size_classes", "size_counts", "tensor_size_distribution"]
