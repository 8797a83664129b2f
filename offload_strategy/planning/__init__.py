"""Planning: pure functions from a profile and a machine to a plan. Nothing here imports torch,
so plans can be made, tested and simulated anywhere. One module per paper."""

from .tencache import SizeClass, buffer_counts, size_classes, size_counts, tensor_size_distribution

__all__ = ["SizeClass", "buffer_counts", "size_classes", "size_counts", "tensor_size_distribution"]
