"""Buffers a block changes in place, under blocks recomputed in backward. A checkpointed block runs
its forward twice: once in the forward, once in backward to rebuild its activations. BatchNorm's
running statistics took a second update there, and spectral norm's power-iteration vectors and a
user's running statistic, which the forward reads after updating, were read by the recomputation
already updated: its activations were not the forward's, and the gradients were wrong from the
first step. Each model is trained side by side with plain Lightning with its blocks checkpointed
(inputs kept in the GPU tier, or in host memory) and under the default policy (whose profiled
steps checkpoint every block after the first): the same losses, weights and buffers bit for bit
(fp32, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import lightning as L
import pytest
import torch
from torch import nn

from offload_strategy import TieredStrategy
from tests.helpers import assert_same_weights
from tests.test_recipes import Net, fit, tiered


class NormedBlock(nn.Module):
    """A linear layer and batch norm over its features (every token one sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.norm = nn.BatchNorm1d(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x).flatten(0, 1)).view_as(x)


class BatchNormNet(Net):
    """Four residual blocks, each with BatchNorm1d: running_mean, running_var, num_batches_tracked."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(NormedBlock() for _ in range(4))


class ConvBlock(nn.Module):
    """A 3x3 convolution and BatchNorm2d (momentum None: the cumulative average that reads num_batches_tracked)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4, momentum=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


class BatchNorm2dNet(L.LightningModule):
    """Token ids as 4-channel 4x2 images through three convolution blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 4)
        self.blocks = nn.ModuleList(ConvBlock() for _ in range(3))
        self.head = nn.Linear(4 * 8, 256)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = self.embed(batch[:, :8]).transpose(1, 2).reshape(-1, 4, 4, 2)
        for block in self.blocks:
            x = x + block(x)
        return nn.functional.cross_entropy(self.head(x.flatten(1)), batch[:, -1])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SpectralBlock(nn.Module):
    """A linear layer under spectral norm: its power iteration updates the buffers ``_u`` and
    ``_v`` in each training forward, and the weight it gives is computed from the updated ones."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.utils.parametrizations.spectral_norm(nn.Linear(32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class SpectralNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SpectralBlock() for _ in range(4))


class RunningScale(nn.Module):
    """A user's running statistic, updated in place and then read by the output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.register_buffer("running", torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        with torch.no_grad():
            self.running.mul_(0.9).add_(y.abs().mean(dim=(0, 1)))
        return y / self.running


class RunningNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(RunningScale() for _ in range(4))


MODELS: dict[str, Callable[[], L.LightningModule]] = {
    "batchnorm1d": BatchNormNet, "batchnorm2d": BatchNorm2dNet, "spectral-norm": SpectralNet, "user-buffer": RunningNet,
}


def _buffers(model: L.LightningModule) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def assert_trains_as_plain(tmp_path: Path, make: Callable[[], L.LightningModule], strategy: TieredStrategy, steps: int = 4,
                           callbacks: tuple = ()) -> None:
    plain_losses, plain_state, plain = fit("auto", tmp_path / "plain", make, steps=steps)
    losses, state, model = fit(strategy, tmp_path / "tiered", make, steps=steps, callbacks=callbacks)
    assert _buffers(plain), "the model has no buffers: the test tests nothing"
    assert losses == plain_losses
    assert_same_weights(plain_state, state)  # parameters and persistent buffers
    assert_same_weights(_buffers(plain), _buffers(model))  # every buffer, persistent or not


@pytest.mark.parametrize("activations", ["checkpoint", "checkpoint_host"])
@pytest.mark.parametrize("model", list(MODELS))
def test_checkpointed_blocks_change_their_buffers_as_plain_training(tmp_path, model, activations):
    assert_trains_as_plain(tmp_path, MODELS[model], tiered("host", tmp_path, activations=activations))


# GPU tiers that offload some units under the default policy, above the least its activations need
DEFAULT_POLICY_TIERS = {"batchnorm1d": "400KiB", "batchnorm2d": "120KiB", "spectral-norm": "400KiB", "user-buffer": "400KiB"}


class FirstStepPolicies(L.Callback):
    def __init__(self) -> None:
        self.policies: list[str] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self.policies:
            self.policies = [str(p) for p in trainer.strategy.tiered.activations.policies]


@pytest.mark.parametrize("model", list(MODELS))
def test_the_default_policys_recomputed_blocks_change_their_buffers_as_plain_training(tmp_path, model):
    strategy, seen = TieredStrategy(gpu_memory=DEFAULT_POLICY_TIERS[model], host_memory="1GiB"), FirstStepPolicies()
    assert_trains_as_plain(tmp_path, MODELS[model], strategy, steps=6, callbacks=(seen,))
    assert seen.policies[0] == "keep" and set(seen.policies[1:]) == {"checkpoint"}, seen.policies  # the profiled steps
    assert strategy.metrics().get("units/host", 0) > 0, "nothing was offloaded: the test does not test the default policy"


# -- by hand ----------------------------------------------------------------------------------------


class Counting(nn.Module):
    """Counts its calls in a buffer and scales by it; holds a constant it never writes."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("constant", torch.full((64,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x * self.calls * self.constant[: x.shape[-1]]


def test_a_recomputation_sees_the_buffers_as_the_forward_found_them_and_leaves_them_as_the_forward_left_them():
    """By hand: the forward writes ``calls`` (0 to 1); only its value before is kept (the constant
    it never wrote is not); each recomputation, a second backward's too, starts from 0 and writes
    a copy; afterwards the module holds its own tensor again, at 1, its version as the forward left it."""
    from offload_strategy.runtime.activations.buffer_replay import BufferReplay

    module = Counting()
    calls = module.calls
    replay = BufferReplay(module)
    with replay.forward():
        module(torch.ones(4))
    assert calls.item() == 1 and replay.held_bytes == calls.element_size()
    version = calls._version
    for _ in range(2):
        with replay.recomputing():
            assert module.calls is not calls and module.calls.item() == 0
            assert torch.equal(module(torch.ones(4)), torch.full((4,), 2.0))  # what the forward computed
        assert module.calls is calls and calls.item() == 1 and calls._version == version


def test_a_buffer_two_modules_share_is_one_buffer_in_the_recomputation():
    from offload_strategy.runtime.activations.buffer_replay import BufferReplay

    first, second = Counting(), Counting()
    second.calls = first.calls
    both = nn.Sequential(first, second)
    replay = BufferReplay(both)
    with replay.forward():
        both(torch.ones(4))
    assert first.calls.item() == 2
    with replay.recomputing():
        assert first.calls is second.calls and first.calls.item() == 0
        both(torch.ones(4))
        assert first.calls.item() == 2
    assert first.calls is second.calls and first.calls.item() == 2


def test_batch_norms_running_statistics_are_kept_though_their_version_counters_do_not_move():
    """Batch norm's kernel writes the running statistics without moving their version counters;
    they are counted written anyway (in training mode only: in evaluation mode nothing is kept)."""
    from offload_strategy.runtime.activations.buffer_replay import BufferReplay

    norm = nn.BatchNorm1d(8)
    versions = norm.running_mean._version, norm.running_var._version
    replay = BufferReplay(norm)
    with replay.forward():
        norm(torch.randn(16, 8))
    assert (norm.running_mean._version, norm.running_var._version) == versions  # why they are counted by their module
    assert replay.held_bytes == 2 * 8 * 4 + 8
    norm.eval()
    replay = BufferReplay(norm)
    with replay.forward():
        norm(torch.randn(16, 8))
    assert replay.held_bytes == 0


class Residual(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.body = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


@pytest.mark.parametrize("make", [NormedBlock, SpectralBlock, RunningScale])
def test_a_second_backward_recomputes_from_the_forwards_buffers_again(make):
    """``backward(retain_graph=True)`` twice: each recomputation starts from the values the
    forward found; the gradients are plain training's, twice over, and the buffers the forward's."""
    from offload_strategy.runtime.activations.policies import ActivationPolicies

    def run(checkpointed: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(*(Residual(make()) for _ in range(3)))
        policies = ActivationPolicies(model, "checkpoint") if checkpointed else None
        x = torch.randn(2, 5, 32, requires_grad=True)
        loss = model(x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        if policies is not None:
            policies.remove()
        return [x.grad, *(p.grad for p in model.parameters())], _buffers(model)

    plain_grads, plain_buffers = run(False)
    grads, buffers = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads))
    assert_same_weights(plain_buffers, buffers)
