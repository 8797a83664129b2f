"""Lightning's precision flags under offloading.

``*-mixed`` keeps fp32 parameters, so tiered training must equal plain training bit for bit.
``*-true`` computes in low precision; tiered training updates fp32 masters off the GPU tier and
refreshes the low-precision copy after each update. Plain Lightning updates the low-precision
parameters themselves, so the reference here is plain Lightning doing what tiered promises, by
hand: fp32 masters, fp32 gradients and states, the low-precision copy refreshed after each step.
Same operations in the same order give the same bits, so the comparison is exact.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from offload_strategy.demos import CausalLM
from offload_strategy import TieredStrategy
from tests.helpers import PARAMETERS_ONLY, assert_same_weights, train
from tests.test_offload import GPT2_4L, beside_kept, gpt2_4l, param_bytes

# the kept layout's peak in the GPU tier, measured in the first training step, per precision: the
# tiny GPT-2's (4 x 32-wide blocks, batch 4 x 32) and test_optimizer_offload's Net's
GPT2_KEPT_PEAK = {"bf16-mixed": 822_916, "bf16-true": 669_060, "16-true": 669_060}
NET_KEPT_PEAK = {"bf16-mixed": 248_228, "bf16-true": 120_242}


def tiers(path: Path, precision: str):
    """Some units in the GPU tier, some on host, the rest on NVMe (at fp32 and at bf16): 0.3 of the
    fp32 parameter bytes for the parameters beside the kept layout's peak at ``precision``."""
    total = param_bytes(gpt2_4l)
    return TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.3, total, GPT2_KEPT_PEAK[precision]), host_memory=int(4.2 * total),
                          nvme_path=path, nvme_memory="64MiB")


class Homes(L.Callback):
    """Records where units live and what dtypes masters and compute copies have."""

    def __init__(self) -> None:
        self.homes: set[str] = set()
        self.master_dtypes: set[torch.dtype] = set()
        self.param_dtypes: set[torch.dtype] = set()

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        engine = trainer.strategy.engine
        if engine is None and trainer.global_step == 1:
            return  # the first step's tier holds the kept layout's room too: offloading starts after it
        self.homes |= {s.home for s in engine.states}
        for slot in next(iter(engine.updater.optimizers.values())).slots.values():
            self.master_dtypes |= {m.dtype for m in slot.masters}
        self.param_dtypes |= {p.dtype for p in pl_module.parameters()}


class FP32MasterLM(CausalLM):
    """Plain-Lightning reference: the user's optimizer steps fp32 masters with fp32 gradients, and
    the low-precision parameters are refreshed from them after each step."""

    def __init__(self) -> None:
        super().__init__(family="gpt2", config=GPT2_4L, lr=1e-2, warmup_steps=2)
        self.fp32: dict[nn.Parameter, torch.Tensor] = {}

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        low = {p: p.data for p in params}

        def closure():
            loss = optimizer_closure()  # forward and backward in low precision
            for p in params:  # the optimizer sees the masters and their fp32 gradients
                grad = self.master_gradient(p)
                p.data = self.fp32.setdefault(p, p.data.float())
                p.grad = grad
            return loss

        optimizer.step(closure=closure)
        with torch.no_grad():
            for p in params:
                p.data = low[p]
                p.data.copy_(self.fp32[p])

    def master_gradient(self, p: torch.Tensor):
        return p.grad.float() if p.grad is not None else None


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_true_precision_updates_fp32_masters_off_the_gpu_tier(tmp_path, precision):
    reference_losses, reference_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=FP32MasterLM, precision=precision)
    homes = Homes()
    losses, weights, _ = train(tiers(tmp_path / "nvme", precision), tmp_path / "tiered", epochs=2, make_model=gpt2_4l, precision=precision, extra_callbacks=(homes,))
    low = torch.bfloat16 if precision == "bf16-true" else torch.float16
    assert homes.homes == {"gpu", "host", "nvme"}
    assert homes.param_dtypes == {low} and homes.master_dtypes == {torch.float32}
    assert all(w.dtype == low for w in weights.values())
    assert losses == reference_losses
    assert_same_weights(reference_weights, weights)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_true_precision_keeps_fp32_masters_when_everything_fits(tmp_path, precision):
    """With a GPU tier that holds everything the strategy ran without an engine, so plain
    Lightning updated the 16-bit parameters themselves: the same recipe trained with fp32 masters
    or without them depending on gpu_memory. The engine now keeps the masters in the GPU tier."""
    reference_losses, reference_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=FP32MasterLM, precision=precision)
    homes = Homes()
    # placement fill: the search's profiled steps would stream the units while they measure the activations
    strategy = TieredStrategy(gpu_memory="1GiB", host_memory="1GiB", policy={"name": "auto", "placement": "fill"})
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=gpt2_4l, precision=precision, extra_callbacks=(homes,))
    assert homes.homes == {"gpu"} and homes.master_dtypes == {torch.float32}
    assert losses == reference_losses
    assert_same_weights(reference_weights, weights)


def test_true_precision_differs_from_updating_the_low_precision_copy(tmp_path):
    """The masters matter: updating bf16 parameters directly (plain bf16-true) loses small updates."""
    _, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l, precision="bf16-true")
    _, weights, _ = train(tiers(tmp_path / "nvme", "bf16-true"), tmp_path / "tiered", epochs=2, make_model=gpt2_4l, precision="bf16-true")
    assert any(not torch.equal(plain_weights[k], weights[k]) for k in weights)


# 16-mixed on the CPU is bf16-mixed in Lightning; with a loss scaler it is tested in test_optimizer_offload.
@pytest.mark.parametrize("precision", ["bf16-mixed"])
def test_mixed_precision_matches_plain_training(tmp_path, precision):
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l, precision=precision)
    homes = Homes()
    losses, weights, _ = train(tiers(tmp_path / "nvme", precision), tmp_path / "tiered", epochs=2, make_model=gpt2_4l, precision=precision, extra_callbacks=(homes,))
    assert {"host", "nvme"} <= homes.homes and homes.master_dtypes == {torch.float32}
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_true_precision_resumes_exactly_with_masters_in_the_checkpoint(tmp_path):
    full_losses, full_weights, _ = train(tiers(tmp_path / "nvme-full", "bf16-true"), tmp_path / "full", epochs=2, make_model=gpt2_4l, precision="bf16-true")
    train(tiers(tmp_path / "nvme-a", "bf16-true"), tmp_path / "a", epochs=2, stop_after_epochs=1, save_every_epoch=True, make_model=gpt2_4l, precision="bf16-true")
    checkpoint = tmp_path / "a" / "ckpt" / "epoch=0.ckpt"
    state = torch.load(checkpoint, weights_only=True)["optimizer_states"][0]["state"]
    masters = [v["master"] for v in state.values()]
    model = gpt2_4l()
    model.configure_model()
    assert len(masters) == len(list(model.parameters())) and all(m.dtype == torch.float32 for m in masters)
    assert all(torch.isfinite(m).all() for m in masters)
    losses, weights, _ = train(tiers(tmp_path / "nvme-b", "bf16-true"), tmp_path / "b", epochs=2, resume=checkpoint, make_model=gpt2_4l, precision="bf16-true")
    assert losses == full_losses[len(full_losses) - len(losses) :]
    assert_same_weights(full_weights, weights)


def test_true_precision_checkpoints_load_into_plain_training_and_back(tmp_path):
    """A tiered bf16-true checkpoint resumes in plain bf16-true (the extra master is ignored there),
    and a plain one resumes in tiered (masters start from the bf16 parameters)."""
    for first, second in (("tiered", "auto"), ("auto", "tiered")):
        make = lambda kind, tag: tiers(tmp_path / f"nvme-{first}-{tag}", "bf16-true") if kind == "tiered" else "auto"  # noqa: E731
        root = tmp_path / f"{first}-then-{second}"
        train(make(first, "a"), root / "a", epochs=2, stop_after_epochs=1, save_every_epoch=True, make_model=gpt2_4l, precision="bf16-true")
        checkpoint = root / "a" / "ckpt" / "epoch=0.ckpt"
        losses, weights, _ = train(make(second, "b"), root / "b", epochs=2, resume=checkpoint, make_model=gpt2_4l, precision="bf16-true")
        assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
        assert all(w.dtype == torch.bfloat16 and torch.isfinite(w).all() for w in weights.values())


class FP32MasterMixin:
    """Plain-Lightning reference for any module: the same fp32-master step as FP32MasterLM."""

    optimizer_step = FP32MasterLM.optimizer_step
    master_gradient = FP32MasterLM.master_gradient


def fp32_master_net(name: str):
    from tests.test_optimizer_offload import Net

    class Reference(FP32MasterMixin, Net):
        def __init__(self) -> None:
            super().__init__(name)
            self.fp32 = {}

    return Reference()


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("name", ["adamw", "adamw-fused", "adam-amsgrad", "sgd-nesterov"])
def test_every_optimizer_in_every_precision(tmp_path, precision, name):
    """Each optimizer with its per-step LR schedule, parameters offloaded to host memory."""
    from tests.test_optimizer_offload import Net
    from tests.test_optimizer_offload import param_bytes as net_bytes

    half = precision.endswith("-true")
    reference = (lambda: fp32_master_net(name)) if half else (lambda: Net(name))
    expected_losses, expected_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=reference, precision=precision)
    homes = Homes()
    strategy = TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=int(0.85 * net_bytes() / (2 if half else 1)) + NET_KEPT_PEAK[precision], host_memory="1GiB")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=lambda: Net(name), precision=precision, extra_callbacks=(homes,))
    assert "host" in homes.homes and homes.master_dtypes == {torch.float32}
    assert losses == expected_losses
    assert_same_weights(expected_weights, weights)


class FP32AccumulatingLM(FP32MasterLM):
    """The reference, accumulating gradients in fp32 as they arrive (what tiered does for every
    unit under ``*-true``), and clipping the fp32 gradients of the masters."""

    def on_fit_start(self) -> None:
        self.accumulated: dict[nn.Parameter, torch.Tensor] = {}

        def accumulate(p: torch.Tensor) -> None:
            total = self.accumulated.get(p)
            self.accumulated[p] = p.grad.to(torch.float32) if total is None else total.add_(p.grad)
            p.grad = None

        for p in self.parameters():
            p.register_post_accumulate_grad_hook(accumulate)

    def master_gradient(self, p: torch.Tensor):
        return self.accumulated.pop(p, None)


def test_true_precision_accumulates_and_clips_in_fp32(tmp_path):
    """Accumulation over 2 micro-batches and clipping by norm, units in every tier: gradients of
    every unit, persistent ones included, are summed and clipped in fp32."""
    kwargs = dict(precision="bf16-true", accumulate_grad_batches=2, gradient_clip_val=0.05)
    expected_losses, expected_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=FP32AccumulatingLM, **kwargs)
    homes = Homes()
    losses, weights, _ = train(tiers(tmp_path / "nvme", "bf16-true"), tmp_path / "tiered", epochs=2, make_model=gpt2_4l, extra_callbacks=(homes,), **kwargs)
    assert homes.homes == {"gpu", "host", "nvme"}
    assert losses == expected_losses
    assert_same_weights(expected_weights, weights)
