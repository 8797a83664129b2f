"""What an evicted unit's parameters point at. PyTorch drops a parameter's gradient accumulator
when its ``.data`` moves to another device, so inside a step on a GPU a host unit must not point
back at host memory: a parameter used twice in one graph (a tied embedding evicted between its
uses) would get a second accumulator and its unit an update per half of its gradient (found on an
H200, docs/benchmarks.md "On a GPU"). The decision is checked here with a stand-in for the CUDA
view; tests/test_gpu.py checks the training on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from offload_strategy.planning.placement import HOST, NVME
from offload_strategy.runtime.params import cache as cache_module
from offload_strategy.runtime.params.cache import UnitCache


def test_pytorch_drops_the_accumulator_when_data_changes_type():
    """The behaviour the binding works around. PyTorch's ``set_data`` drops the accumulator when the
    new data's device or dtype differs; on a CPU machine another dtype stands for another device."""
    p = torch.nn.Parameter(torch.ones(3))
    first = (p * 2).sum()  # the graph holds p's accumulator
    p.data = torch.ones(3, dtype=torch.float64)
    p.data = torch.ones(3)
    second = (p * 3).sum()
    assert first.grad_fn.next_functions[0][0].next_functions[0][0] is not second.grad_fn.next_functions[0][0].next_functions[0][0]
    q = torch.nn.Parameter(torch.ones(3))
    first = (q * 2).sum()
    q.data = torch.zeros(3)  # the same device: the same accumulator
    second = (q * 3).sum()
    assert first.grad_fn.next_functions[0][0].next_functions[0][0] is second.grad_fn.next_functions[0][0].next_functions[0][0]


def _cache(compute: str, active: bool, states: list) -> UnitCache:
    cache = UnitCache.__new__(UnitCache)
    bound: dict[int, list] = {}
    cache.ctx = SimpleNamespace(device=SimpleNamespace(compute=torch.device(compute)), step=SimpleNamespace(active=active), states=states)
    cache.bind = lambda s, tensors: bound.__setitem__(s.unit.index, tensors)  # type: ignore[method-assign]
    cache.on_device_views = set()
    cache.held = set()
    cache.bound = bound  # what each unit was bound to, for the test
    return cache


def _unit(index: int, home: str) -> SimpleNamespace:
    return SimpleNamespace(unit=SimpleNamespace(index=index), home=home, home_views=[torch.ones(2)], placeholders=[torch.zeros(2)], device_slot=None)


def test_inside_a_step_on_a_gpu_host_units_point_at_views_of_their_homes(monkeypatch):
    views = []
    monkeypatch.setattr(cache_module, "can_view", lambda host, device: True)
    monkeypatch.setattr(cache_module, "device_view", lambda host, device: views.append(host) or host.clone())
    host, nvme = _unit(0, HOST), _unit(1, NVME)
    cache = _cache("cuda", True, [host, nvme])
    away = cache._away(host)
    assert views == host.home_views and away[0] is not host.home_views[0]  # a view of the home, not the host tensor
    assert cache._away(nvme) is nvme.placeholders
    assert cache.on_device_views == {0}
    # after the step (the optimizer step evicts all), back at their host tensors
    cache.ctx.step.active = False
    cache.evict_all()
    assert cache.bound[0] is host.home_views and cache.on_device_views == set()


def test_outside_a_step_or_off_a_gpu_host_units_point_at_their_homes(monkeypatch):
    monkeypatch.setattr(cache_module, "can_view", lambda host, device: True)
    host = _unit(0, HOST)
    assert _cache("cuda", False, [host])._away(host) is host.home_views  # between steps: the true values, where callbacks read them
    assert _cache("cpu", True, [host])._away(host) is host.home_views  # the emulated tier: no device change
    monkeypatch.setattr(cache_module, "can_view", lambda host, device: False)
    assert _cache("cuda", True, [host])._away(host) is host.home_views  # a home the GPU cannot map (not pinned)
