"""On a CUDA GPU: parameters are created in host memory, placed by the engine, and training matches
plain Lightning on the same GPU. Skipped where no GPU is present."""

from __future__ import annotations

import pytest
import torch

from offload_strategy import PRESETS, TieredStrategy
from tests.helpers import PARAMETERS_ONLY, train
from tests.test_offload import gpt2_4l, param_bytes

pytestmark = pytest.mark.gpu


def test_offloaded_training_on_a_gpu_matches_plain(tmp_path):
    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    recorded = {}

    class Where(__import__("lightning").Callback):
        def on_train_batch_end(self, trainer, *args):
            engine = trainer.strategy.engine
            recorded["homes"] = {s.home for s in engine.states}
            recorded["arena"] = engine.arena.device.type

    losses, weights, _ = train(TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=int(0.3 * total), host_memory="1GiB"), tmp_path / "tiered", epochs=2,
                               make_model=gpt2_4l, accelerator="gpu", extra_callbacks=(Where(),))
    assert recorded["arena"] == "cuda" and "host" in recorded["homes"]
    # cuBLAS may pick other kernels for other memory layouts: equal to within float32 rounding
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for name in plain_weights:
        torch.testing.assert_close(weights[name].cpu(), plain_weights[name].cpu(), rtol=1e-4, atol=1e-5)


def test_the_default_policy_on_a_gpu_searches_a_plan_and_matches_plain(tmp_path):
    """The joint search on a real GPU tier: activations now live in it, so the budget (twice the
    parameters) holds parameters and the blocks' layout together."""
    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    strategy = TieredStrategy(gpu_memory=2 * total, host_memory="1GiB")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    assert strategy.activation_plan is not None
    assert strategy.tiered.activations.gpu_parameter_bytes() + strategy.activation_plan.peak_bytes <= 2 * total
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for name in plain_weights:
        torch.testing.assert_close(weights[name].cpu(), plain_weights[name].cpu(), rtol=1e-4, atol=1e-5)


class Where(__import__("lightning").Callback):
    arena = ""

    def on_train_batch_end(self, trainer, *args):
        self.arena = trainer.strategy.engine.arena.device.type


def _max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def plain_on_gpu(tmp_path_factory):
    return {precision: train("auto", tmp_path_factory.mktemp(f"plain-{precision}"), epochs=2, make_model=gpt2_4l, accelerator="gpu", precision=precision)
            for precision in ("32-true", "bf16-mixed")}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("name", [n for n in PRESETS if n != "none"])
def test_every_preset_on_a_gpu_trains_as_plain(name, precision, plain_on_gpu, tmp_path, record_property):
    """Each preset on the real CUDA path (pinned slabs, copy streams, NVMe files, DHA views where the
    preset asks for them), beside plain Lightning on the same GPU. fp32: equal to float32 rounding
    (cuBLAS may choose other kernels for other memory layouts). bf16-mixed: both keep fp32 masters and
    run the same autocast ops, so only kernel choice can differ; bf16 rounding (2**-8) of one
    matmul that chose another kernel moves a loss by ~1e-3 at most over 12 steps."""
    total = param_bytes(gpt2_4l)
    gpu = int((1.1 if name == "zero_offload" else 0.5) * total) + 2**20
    strategy = TieredStrategy(policy=name, gpu_memory=gpu, host_memory=int(6 * total), nvme_path=tmp_path / "nvme", nvme_memory="64MiB")
    where = Where()
    losses, weights, _ = train(strategy, tmp_path / "run", epochs=2, make_model=gpt2_4l, accelerator="gpu", precision=precision, extra_callbacks=(where,))
    plain_losses, plain_weights, _ = plain_on_gpu[precision]
    diff = _max_weight_diff(weights, plain_weights)
    record_property("max_weight_diff", diff)
    record_property("bit_identical", losses == plain_losses and diff == 0.0)
    record_property("metrics", {k: v for k, v in strategy.metrics().items() if k.startswith(("units/", "link/", "optimizer/"))})
    assert where.arena == "cuda"
    rel, atol = (1e-5, 1e-5) if precision == "32-true" else (2e-3, 1e-3)
    assert losses == pytest.approx(plain_losses, rel=rel)
    for k in plain_weights:
        torch.testing.assert_close(weights[k].cpu(), plain_weights[k].cpu(), rtol=10 * rel, atol=atol)


def test_fabric_on_a_gpu_trains_as_plain():
    from offload_strategy import TieredFabricStrategy
    from tests.test_fabric import fabric_train

    plain_losses, plain_weights, _ = fabric_train("auto", accelerator="cuda")
    losses, weights, fabric = fabric_train(TieredFabricStrategy(policy=PARAMETERS_ONLY, gpu_memory="256KiB"), accelerator="cuda")
    assert fabric.strategy.metrics()["units/host"] > 0
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for k in plain_weights:
        torch.testing.assert_close(weights[k].cpu(), plain_weights[k].cpu(), rtol=1e-4, atol=1e-5)


def test_tiered_ddp_on_nccl_trains_as_ddp(tmp_path):
    """One rank on NCCL: the process group, the reductions of offloaded units' gradients and the
    sharded states run their CUDA path."""
    from offload_strategy import TieredDDPStrategy

    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("ddp", tmp_path / "plain", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    strategy = TieredDDPStrategy(policy=PARAMETERS_ONLY, gpu_memory=int(0.3 * total), host_memory="1GiB", process_group_backend="nccl")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for k in plain_weights:
        torch.testing.assert_close(weights[k].cpu(), plain_weights[k].cpu(), rtol=1e-4, atol=1e-5)
