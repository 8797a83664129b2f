"""Units computed in place at home (``placement.dha``) are refused on a GPU, with the units named,
until binding device views of the pinned home has run on one: they were bound to host tensors
that GPU kernels cannot take."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from offload_strategy.hardware.device import EmulatedDevice
from offload_strategy.planning.placement import UnitSize, place_units
from offload_strategy.runtime.engine import TieredEngine
from offload_strategy.runtime.units import build_units


class NotEmulated(EmulatedDevice):
    """Stands for a CUDA device: the engine asks only ``is_emulated``."""

    is_emulated = False


def test_dha_units_are_refused_on_a_device_that_is_not_emulated():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    units, users = build_units(model)
    sizes = [UnitSize(u.index, u.nbytes, u.nbytes) for u in units]
    placement = place_units(sizes, [[u.index for u in used] for used in users.values()], gpu_bytes=1 << 20, host_bytes=1 << 20,
                            nvme_bytes=0, state_factor=2)
    placement = dataclasses.replace(placement, dha=frozenset({1}))
    before = [p.detach().clone() for p in model.parameters()]
    with NotEmulated(capacity=1 << 20) as device, pytest.raises(ValueError, match=r"placement.dha puts 1 unit\(s\) \(indices \[1\]\)"):
        TieredEngine(model, units, users, placement, device)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # refused before anything moved
