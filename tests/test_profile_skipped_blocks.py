"""The default policy's profiled forward where a step skips blocks (LayerDrop), the first among
them: the first block that runs is the one kept and counted, what the forward keeps outside the
blocks is read from that block's start to the last block that ran's end, and the profile is
complete at the forward's end, the skipped blocks taken as alike."""

from __future__ import annotations

import torch
from torch import nn

from offload_strategy.runtime.activations.policies import ActivationPolicies
from offload_strategy.runtime.activations.saved_bytes import SavedBytes


class Skipping(nn.Module):
    """Four linear blocks; ``ran`` says which a forward runs."""

    def __init__(self, ran: tuple[int, ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.ran = ran

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.sigmoid(x)  # saved before the blocks
        for index in self.ran:
            x = self.blocks[index](x)
        return torch.exp(x).sum()  # saved after them


def _profiled_forward(ran: tuple[int, ...]) -> tuple[ActivationPolicies, SavedBytes, list[int]]:
    """One profiled training forward, every saved tensor counted as the strategy's hooks do."""
    model = Skipping(ran)
    saved, first = SavedBytes(), []
    policies = ActivationPolicies(model, "auto")
    policies.after_first_block = lambda: first.append(policies.profile.measured)
    policies.saved_so_far = lambda: saved

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not policies.is_parameter(t):
            saved.add(t)
        return t

    policies.outer = (pack, lambda t: t)
    policies.param_storages.update(p.untyped_storage().data_ptr() for p in model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(*policies.outer):
        loss = model(torch.randn(3, 8, requires_grad=True))
    policies.end_forward()
    loss.backward()
    return policies, saved, first


def test_a_profiled_forward_that_skips_the_first_block_measures_the_first_that_runs():
    policies, saved, first = _profiled_forward(ran=(1, 3))
    profile = policies.profile
    assert policies.profiled
    assert profile.measured == 1 and first == [1]  # the refusal from the first block came at block 1
    one_input = 3 * 8 * 4
    assert profile.activation_bytes > 0  # block 1 kept its activations (block 0's policy was the kept one)
    # from block 1's start: the sigmoid's output before it; to block 3's end: the exp's after it
    assert profile.saved_before_blocks == one_input
    assert saved.bytes - profile.saved_before_blocks - profile.blocks_saved_bytes == one_input
    costs = policies.block_costs()
    assert [c.input_bytes for c in costs] == [one_input] * 4  # the skipped blocks taken as alike
    assert len({c.activation_bytes for c in costs}) == 1 and all(c.forward_seconds > 0 for c in costs)


def test_a_profiled_forward_that_runs_no_block_measures_nothing():
    policies, _, first = _profiled_forward(ran=())
    assert not policies.profiled and first == []
