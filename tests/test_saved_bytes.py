"""What a forward keeps for backward, counted as memory holds it (``runtime/activations/saved_bytes.py``)."""

from __future__ import annotations

import torch

from offload_strategy.runtime.activations.saved_bytes import SavedBytes


def saved_by(forward) -> tuple[int, int]:
    """(every saved tensor's bytes summed, SavedBytes' count) over ``forward()``."""
    summed, counted = [0], SavedBytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        summed[0] += t.numel() * t.element_size()
        counted.add(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    out.sum().backward()
    return summed[0], counted.bytes


def test_cross_entropy_holds_its_log_softmax_once():
    """log_softmax saves its output, and nll_loss saves the same tensor: 100 x 50 floats held once
    (20,000 bytes), with the 100 int64 targets (800 bytes) and nll_loss's total weight (one float);
    the sum counts the 20,000 twice."""
    logits = torch.randn(100, 50, requires_grad=True)
    target = torch.randint(0, 50, (100,))
    summed, counted = saved_by(lambda: torch.nn.functional.cross_entropy(logits, target))
    assert counted == 20_000 + 800 + 4
    assert summed == counted + 20_000


def test_views_of_one_output_count_once_each_and_never_beyond_their_storage():
    """A fused projection split in three: three distinct views of its 8 x 12 floats, 128 bytes
    each, 384 in all; multiplied with themselves, each view is saved twice (by ``mul``, as both
    operands). With the projection's input (8 x 4 floats, 128 bytes): 512 held, 896 summed."""
    x = torch.randn(8, 4)
    w = torch.randn(4, 12, requires_grad=True)

    def forward() -> torch.Tensor:
        q, k, v = (x @ w).split(4, dim=1)
        return q * q + k * k + v * v

    summed, counted = saved_by(forward)
    assert counted == 8 * 12 * 4 + 8 * 4 * 4 == 512
    assert summed == 2 * 384 + 128


def test_a_slice_of_a_large_buffer_counts_the_slice():
    """A block that saves 10 rows of a 1,000-row buffer holds the buffer anyway (it is the
    module's): 10 x 16 floats, 640 bytes, not the storage's 64,000."""
    table = torch.randn(1000, 16)
    w = torch.randn(16, 16, requires_grad=True)
    summed, counted = saved_by(lambda: table[:10] @ w)
    assert counted == summed == 640


def test_a_freed_storage_whose_address_comes_back_is_counted_again():
    """A swapped block's tensors are copied out and freed during forward: a later tensor at the
    same address is new memory, not the freed one again. Two tensors over one Python buffer have
    the same address: while the first lives they are one memory; once it is gone, the second is
    counted."""
    memory = bytearray(1024)
    counted = SavedBytes()
    a = torch.frombuffer(memory, dtype=torch.float32)
    counted.add(a)
    b = torch.frombuffer(memory, dtype=torch.float32)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    counted.add(b)
    assert counted.bytes == 1024
    del a, b
    c = torch.frombuffer(memory, dtype=torch.float32)
    counted.add(c)
    assert counted.bytes == 2 * 1024
