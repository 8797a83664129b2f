"""Gradients: their path out of backward, their buffers, clipping, and the exchange across ranks."""
