"""At the end of an optimizer step no copy still reads or writes a host home: callbacks (an EMA, a
``load_state_dict``) and lending write them then. The race check keeps CUDA's books on the CPU
(copies waited for on the device only stay in flight), so a copy out of a home that the step
never waited for on the host would raise here."""

from __future__ import annotations

import torch
from torch import nn

from offload_strategy.hardware.device import EmulatedDevice, RaceCheck
from offload_strategy.planning.placement import UnitSize, place_units
from offload_strategy.runtime.engine import TieredEngine
from offload_strategy.runtime.units import build_units


def test_host_homes_may_be_written_once_a_step_ends():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    units, users = build_units(model)
    sizes = [UnitSize(u.index, u.nbytes, u.nbytes) for u in units]
    placement = place_units(sizes, [[u.index for u in used] for used in users.values()], gpu_bytes=36000, host_bytes=1 << 20,
                            nvme_bytes=0, state_factor=2)
    device = EmulatedDevice(capacity=36000, race_check=RaceCheck(seed=3))
    engine = TieredEngine(model, units, users, placement, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert sum(bool(s.home_views) for s in engine.states) >= 3  # homes in host memory
    try:
        for step in range(2):
            engine.begin_step(profile=step == 0)
            with engine.saved_tensor_hooks():
                loss = model(torch.ones(4, 64)).sum()
            engine.begin_backward()
            loss.backward()
            engine.end_backward()
            engine.step(optimizer)
            optimizer.zero_grad()
            for s in engine.states:  # what a callback may write now
                for home in s.home_views:
                    device.check_host_access(home, "writes a parameter at home after the step")
    finally:
        engine.close(materialize=True)
        device.close()
