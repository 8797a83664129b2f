"""A unit's update in host memory steps a large parameter a chunk at a time: the optimizer's
temporaries are a chunk's (``UPDATE_CHUNK_BYTES``, within ``RUNTIME_HOST_ALLOWANCE``), not the
parameter's (AdamW made two as large as it: 200 MiB beside the budgets at a GPT-2 3.3B's 100 MiB
weights), with the same bits as plain training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from offload_strategy import RUNTIME_HOST_ALLOWANCE
from offload_strategy.estimate.live_bytes import LiveBytes
from offload_strategy.runtime.updates.chunks import ELEMENTWISE, UPDATE_CHUNK_BYTES, step_in_chunks
from offload_strategy.runtime.updates.nvme_states import NvmeOptimizerStates, StatesMadeInBuffer
from offload_strategy.runtime.updates.optimizers import UnitOptimizers
from tests.helpers import assert_same_weights
from tests.test_recipes import Net, fit, tiered

# AdamW's single-tensor step holds two temporaries of what it steps at once: ``sqrt`` of the
# second moment and its quotient by the bias correction
ADAMW_TEMPORARIES = 2
# beside them: the scalar states each chunk steps a copy of, the small parameters' temporaries
SMALL = 64 * 2**10

OPTIMIZERS = [
    (torch.optim.AdamW, {"weight_decay": 0.1}), (torch.optim.Adam, {"amsgrad": True}), (torch.optim.Adam, {"foreach": True}),
    (torch.optim.Adam, {"fused": True}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}), (torch.optim.Adagrad, {}),
    (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}), (torch.optim.Adamax, {}), (torch.optim.NAdam, {}), (torch.optim.RAdam, {}),
]


def stepped(cls: type, settings: dict, chunk_bytes: int, made_in: bool = False, steps: int = 3) -> tuple[list[torch.Tensor], Any, Any]:
    """Three steps of ``cls`` over two groups (one tensor too odd for whole chunks), whole or in
    chunks; ``made_in``: the first step under ``StatesMadeInBuffer``, as an NVMe unit's first update."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator).requires_grad_() for shape in [(37, 129), (5,), (300, 7)]]
    optimizer = cls([{"params": params[:2]}, {"params": params[2:], "lr": 0.003}], **settings)
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        with StatesMadeInBuffer(buffer) if made_in and step == 0 else torch.no_grad():
            step_in_chunks(optimizer, chunk_bytes) if chunk_bytes else optimizer.step()
    return params, optimizer, buffer


@pytest.mark.parametrize("cls, settings", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_step_in_chunks_computes_the_whole_steps_bits_and_makes_its_states_where_the_whole_step_does(cls, settings):
    assert cls in ELEMENTWISE
    whole, whole_optimizer, whole_buffer = stepped(cls, settings, 0, made_in=True)
    for chunk_bytes in (4 * 64, 4 * 1000):  # odd sizes too: 1000 elements are rounded to whole vectors
        params, optimizer, buffer = stepped(cls, settings, chunk_bytes, made_in=True)
        for a, b in zip(whole, params):
            assert torch.equal(a, b)
            assert list(whole_optimizer.state[a]) == list(optimizer.state[b])  # the same states, made in the same order
            for key, value in whole_optimizer.state[a].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(optimizer.state[b][key])), key
        assert torch.equal(whole_buffer, buffer)  # each state made where the whole step made it


class Table(Net):
    """Net beside a 16 MiB embedding table: one parameter of two update chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(2 * UPDATE_CHUNK_BYTES // 4 // 32, 32)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x = self.embed(batch[:, :-1]) + self.table(batch[:, :-1])
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(self.norm(x))


class FreshTensors(LiveBytes):
    """``LiveBytes`` of the tensors an operation makes in memory of their own (not a view of a
    buffer the runtime holds, as the states ``StatesMadeInBuffer`` places)."""

    def _count(self, t: torch.Tensor, known: set[int]) -> None:
        if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
            super()._count(t, known)


@pytest.mark.parametrize("placement, trainer_kwargs", [
    ("host", {}), ("nvme", {}),
    ("host", {"gradient_clip_val": 0.05}),  # host units updated speculatively in backward, settled after the norm
], ids=["host", "nvme", "host-clipped"])
def test_a_large_parameters_update_holds_a_chunks_temporaries_and_trains_as_plain(tmp_path: Path, monkeypatch, placement, trainer_kwargs):
    peaks: list[int] = []
    step = UnitOptimizers.step

    def measured(self: UnitOptimizers, *args: Any, **kwargs: Any) -> None:
        with FreshTensors() as live:  # on the thread that updates: the worker, or the training thread
            step(self, *args, **kwargs)
        peaks.append(live.peak - live.bytes)  # beyond what it left: a first step's new states stay (host memory counts them)

    in_place: list[bool] = []
    kept = NvmeOptimizerStates.in_place
    monkeypatch.setattr(NvmeOptimizerStates, "in_place", lambda self, *a: in_place.append(kept(self, *a)) or in_place[-1])

    plain_losses, plain_weights, _ = fit("auto", tmp_path / "plain", Table, steps=3, **trainer_kwargs)
    monkeypatch.setattr(UnitOptimizers, "step", measured)
    losses, weights, _ = fit(tiered(placement, tmp_path, gpu_memory="40MiB"), tmp_path / "tiered", Table, steps=3, **trainer_kwargs)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    # the table's update measured at each step: its temporaries are a chunk's (AdamW's two), which the allowance holds
    assert len(peaks) >= 3 and max(peaks) >= UPDATE_CHUNK_BYTES
    assert max(peaks) <= ADAMW_TEMPORARIES * UPDATE_CHUNK_BYTES + SMALL <= RUNTIME_HOST_ALLOWANCE // 4
    # each NVMe unit's first states, the table's made a chunk at a time, made in the buffer they are stored from
    assert all(in_place) and bool(in_place) == (placement == "nvme")
