"""The optimizer that updates units in host memory: on a GPU the fused CPU kernel (one pass over
parameters, gradients and states), on the emulated tier the user's own settings (bit-identical to
plain training on the same CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_strategy.runtime.updates.optimizers import UnitOptimizers, host_implementation


def test_the_fused_kernel_only_where_results_need_not_match_bit_for_bit():
    adamw = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=0.1)
    assert host_implementation(adamw, exact=True) == {}
    assert host_implementation(adamw, exact=False) == {"fused": True, "foreach": False, "capturable": False}
    assert host_implementation(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1), exact=False) == {"fused": True, "foreach": False}
    assert host_implementation(torch.optim.RMSprop([nn.Parameter(torch.zeros(2))], lr=0.1), exact=False) == {}  # no fused CPU kernel
    differentiable = torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=0.1, differentiable=True)
    assert host_implementation(differentiable, exact=False) == {}


class _Subclass(torch.optim.AdamW):
    pass


def test_a_subclass_keeps_its_own_step():
    assert host_implementation(_Subclass([nn.Parameter(torch.zeros(2))], lr=0.1), exact=False) == {}


def _steps(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor], step, count: int = 4) -> None:
    generator = torch.Generator().manual_seed(3)
    for k in range(count):
        for t in tensors:
            t.grad = torch.randn(t.shape, generator=generator)
        for group in optimizer.param_groups:  # a scheduler's change reaches the units
            group["lr"] = 0.1 / (k + 1)
        step()


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
def test_units_in_host_memory_take_the_settings_and_keep_them_under_a_scheduler(cls):
    torch.manual_seed(0)
    kwargs = {"momentum": 0.9} if cls is torch.optim.SGD else {"weight_decay": 0.1}
    params = [nn.Parameter(torch.randn(64)), nn.Parameter(torch.randn(8, 8))]
    masters = [p.detach().clone() for p in params]
    facade = cls(params, lr=0.1, **kwargs)
    settings = host_implementation(facade, exact=False)
    units = UnitOptimizers(facade, [(0, [params[0]], [masters[0]]), (1, [params[1]], [masters[1]])], host_settings=settings)
    assert units.on_host == {0, 1}

    def step() -> None:
        for index, master in enumerate(masters):
            master.grad = params[index].grad
            units.step(index)

    _steps(facade, params, step)
    for slot in units.slots.values():
        assert slot.inner.param_groups[0]["fused"] is True and slot.inner.param_groups[0]["lr"] == pytest.approx(0.025)
    # the same as one fused optimizer over the same tensors, bit for bit
    torch.manual_seed(0)
    reference = [nn.Parameter(torch.randn(64)), nn.Parameter(torch.randn(8, 8))]
    fused = cls(reference, lr=0.1, fused=True, **kwargs)
    _steps(fused, reference, fused.step)
    for master, expected in zip(masters, reference):
        assert torch.equal(master, expected.detach())
    # and within float32 rounding of the default kernel
    torch.manual_seed(0)
    default = [nn.Parameter(torch.randn(64)), nn.Parameter(torch.randn(8, 8))]
    plain = cls(default, lr=0.1, **kwargs)
    _steps(plain, default, plain.step)
    for master, expected in zip(masters, default):
        torch.testing.assert_close(master, expected.detach(), rtol=1e-6, atol=1e-6)
    assert facade.param_groups[0].get("fused") is None  # the user's optimizer is unchanged


def test_units_on_the_gpu_tier_keep_the_users_settings():
    params = [nn.Parameter(torch.randn(4))]
    facade = torch.optim.AdamW(params, lr=0.1)
    meta_master = torch.empty(4, device="meta")  # a master off the host: not given the host settings
    units = UnitOptimizers(facade, [(0, params, [meta_master])], host_settings=host_implementation(facade, exact=False))
    assert units.on_host == set() and units.slots[0].inner.param_groups[0]["fused"] is None
