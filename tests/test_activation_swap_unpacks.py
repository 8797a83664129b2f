"""A swapped saved tensor unpacked twice in one backward (a custom Function whose backward reads
``ctx.saved_tensors`` twice) counts once towards letting its copy go: the copy's other views,
unpacked later, still find it (they were refused an event that was never made)."""

from __future__ import annotations

import torch

from offload_strategy.hardware.device import make_device
from offload_strategy.runtime.activations.swap import ActivationSwap


def test_a_view_unpacked_twice_counts_once():
    """Three splits of one tensor share one copy: unpacking the first twice, then the other two,
    returns each with its values, and the copy goes once all three were unpacked."""
    product = torch.randn(64, 96)
    q, k, v = product.split(32, dim=1)
    with make_device(torch.device("cpu"), capacity=1 << 20) as device:  # the suite's race check from the environment
        swap = ActivationSwap(device, None, is_parameter=lambda t: False)
        with swap.hooks(0, "swap_host"):
            packed = [swap._pack(0, "swap_host", t) for t in (q, k, v)]
        copy = packed[0].copy
        assert packed[1].copy is copy and packed[2].copy is copy
        first, again = swap._unpack(packed[0]), swap._unpack(packed[0])
        assert copy.back is not None  # k and v are still to come
        rest = [swap._unpack(p) for p in packed[1:]]
        assert copy.back is None  # every view is autograd's now
        for original, returned in zip((q, q, k, v), (first, again, *rest)):
            assert torch.equal(returned, original) and returned.stride() == original.stride()
        later = [swap._unpack(p) for p in packed]  # a second backward through a kept graph fetches again
        assert all(torch.equal(t, o) for t, o in zip(later, (q, k, v))) and copy.back is None


class _ReadsTwice(torch.autograd.Function):
    """``y = a * b``, whose backward reads its saved tensors twice."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, _ = ctx.saved_tensors
        _, b = ctx.saved_tensors
        return grad * b, grad * a


def test_a_backward_reading_saved_tensors_twice_under_swap():
    """Through autograd: the gradients equal those of a run without the swap's hooks."""
    x = torch.randn(64, 96, requires_grad=True)
    w = torch.randn(64, 32, requires_grad=True)

    def run(hooks):
        x.grad = w.grad = None
        with hooks:
            q, k, v = (x * 2).split(32, dim=1)
            out = _ReadsTwice.apply(q, w * (k * v))  # q's node runs first and unpacks twice, then k's and v's
        out.sum().backward()
        return x.grad.clone(), w.grad.clone()

    expected = run(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    with make_device(torch.device("cpu"), capacity=1 << 20) as device:  # the suite's race check from the environment
        swap = ActivationSwap(device, None, is_parameter=lambda t: False)
        swap.begin_forward()
        got = run(swap.hooks(0, "swap_host"))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
