"""Clipping by norm without every gradient in memory at once, bit for bit as
``torch.nn.utils.clip_grad_norm_`` (what Lightning's ``clip_gradients`` calls).

torch's clipping is two passes: the norm of each gradient, then one norm over those norms, and a
coefficient every gradient is multiplied by. The first pass needs each gradient once, so the
engine takes a gradient's norm when its unit's gradients complete (on their way to NVMe) and the
coefficient when backward is over; each gradient is multiplied by it where it is when its update
reads it. The functions below repeat torch's arithmetic in torch's order: norms grouped by device
and dtype (foreach where torch uses it), stacked on the first gradient's device in the groups'
order, and the coefficient ``min(max_norm / (total + 1e-6), 1)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

NORM_TYPE = 2.0  # Lightning clips by the 2-norm


def tensor_norms(tensors: Sequence[torch.Tensor], norm_type: float = NORM_TYPE) -> list[torch.Tensor]:
    """Each tensor's norm, computed as ``clip_grad_norm_`` computes it; in the order given."""
    out: list = [None] * len(tensors)
    if not tensors:
        return out
    grouped = _group_tensors_by_device_and_dtype([list(tensors)], with_indices=True)
    for (device, _), ([grouped_tensors], indices) in grouped.items():
        group = cast(list[torch.Tensor], grouped_tensors)  # torch's grouping keeps Nones; ``tensors`` has none
        norms: Sequence[torch.Tensor]
        if _has_foreach_support(group, device):
            norms = torch._foreach_norm(group, norm_type)
        else:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in group]
        for index, norm in zip(indices, norms):
            out[index] = norm
    return out


def total_norm(norms: Sequence[torch.Tensor], norm_type: float = NORM_TYPE) -> torch.Tensor:
    """The norm of the gradients whose norms are ``norms`` (in the gradients' order)."""
    if not norms:
        return torch.tensor(0.0)
    first_device = norms[0].device
    # a norm has its gradient's device and dtype, so it falls in its gradient's group
    grouped = _group_tensors_by_device_and_dtype([list(norms)])
    ordered = [cast(torch.Tensor, norm).to(first_device) for ([group], _) in grouped.values() for norm in group]  # no Nones in ``norms``
    return torch.linalg.vector_norm(torch.stack(ordered), norm_type)


def clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """What every gradient is multiplied by."""
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
