"""On a CUDA GPU: parameters are created in host memory, placed by the engine, and training matches
plain Lightning on the same GPU. Skipped where no GPU is present."""

from __future__ import annotations

import pytest
import torch

from offload_strategy.demos import CausalLM
from offload_strategy import PRESETS, PolicyConfig, TieredStrategy
from tests.helpers import PARAMETERS_ONLY, train
from tests.test_offload import GPT2_4L, gpt2_4l, param_bytes

pytestmark = pytest.mark.gpu


def test_offloaded_training_on_a_gpu_matches_plain(tmp_path, record_property):
    """The smallest GPU tier, every unit streamed from host memory, updates during backward."""
    policy = PARAMETERS_ONLY
    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    where = Where()
    losses, weights, _ = train(TieredStrategy(policy=policy, gpu_memory=int(0.3 * total), host_memory="1GiB"), tmp_path / "tiered", epochs=2,
                               make_model=gpt2_4l, accelerator="gpu", extra_callbacks=(where,))
    record_property("losses", [losses, plain_losses])
    assert where.arena == "cuda" and "host" in where.homes
    # the tied embedding, evicted between its two uses, once got a second gradient accumulator
    # (its .data had moved to host memory and back) and was updated on each half of its gradient
    assert not where.updated_twice
    # cuBLAS may pick other kernels for other memory layouts: equal to within float32 rounding
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    _weight_differences(weights, plain_weights, 1e-4, 1e-5, steps=len(losses), lr=1e-2)


def test_the_default_policy_on_a_gpu_searches_a_plan_and_matches_plain(tmp_path):
    """The joint search on a real GPU tier: activations now live in it, so the budget (3.2 times
    the parameters) holds parameters, the blocks' layout and the logits together."""
    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    budget = int(3.2 * total)
    strategy = TieredStrategy(gpu_memory=budget, host_memory="1GiB")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    assert strategy.activation_plan is not None
    assert strategy.tiered.activations.gpu_parameter_bytes() + strategy.activation_plan.peak_bytes <= budget
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    _weight_differences(weights, plain_weights, 1e-4, 1e-5, steps=len(losses), lr=1e-2)


class ModelCheckpointedGPT2(CausalLM):
    """Hugging Face's own checkpointing on every layer, reentrant or not."""

    reentrant = False

    def configure_model(self) -> None:
        super().configure_model()
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": self.reentrant})


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_models_own_checkpointing_on_a_gpu_trains_as_plain(tmp_path, reentrant, accelerator="gpu"):
    """Each layer recomputed in backward by the model fetches its units again through the copy
    stream; the default policy plans each layer's units together (their gradient_checkpointing flag)."""
    make = type("Made", (ModelCheckpointedGPT2,), {"reentrant": reentrant})
    build = lambda: make(family="gpt2", config=GPT2_4L, lr=1e-2, warmup_steps=2)  # noqa: E731
    total = param_bytes(build)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=build, accelerator=accelerator)
    strategy = TieredStrategy(gpu_memory=int(0.6 * total) + 400_000, host_memory="1GiB")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=build, accelerator=accelerator)
    assert strategy.planner.model.recomputed_by_model and strategy.metrics().get("units/host", 0) > 0
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    _weight_differences(weights, plain_weights, 1e-4, 1e-5, steps=len(losses), lr=1e-2)


class Where(__import__("lightning").Callback):
    """Where the engine ran each step: its arena's device, the units' homes, units updated twice."""

    def __init__(self) -> None:
        self.arena, self.homes, self.updated_twice = "", set(), set()

    def on_train_batch_end(self, trainer, *args):
        engine = trainer.strategy.engine
        if engine is None:
            self.arena = "none"
            return
        self.arena, self.homes = engine.memory.arena.device.type, {s.home for s in engine.states}
        updated = [index for index, _, _ in engine.updater.log]
        self.updated_twice |= {i for i in updated if updated.count(i) > 1}


def _key_bias(name: str) -> slice:
    """The attention keys' bias inside GPT-2's fused query/key/value bias. Softmax does not change
    when every key moves by the same vector, so its true gradient is zero and autograd gives it
    rounding noise; Adam divides that noise by its own size and moves it by up to the learning rate.
    The host's AdamW rounds differently from CUDA's (fused multiply-adds), so from the second step
    on these entries follow different noise: compared with the learning rate as the tolerance."""
    width = GPT2_4L["n_embd"]
    return slice(width, 2 * width) if name.endswith("attn.c_attn.bias") else slice(0, 0)


def _weight_differences(
    weights: dict[str, torch.Tensor], plain: dict[str, torch.Tensor], rtol: float, atol: float, steps: int, lr: float, outliers: float = 0.0,
) -> dict[str, float]:
    """Max |difference| per tensor. Asserts closeness to (rtol, atol) for all but a share
    ``outliers`` of the elements, and every element, the keys' bias too, within lr per step."""
    out, far, count = {}, 0, 0
    for name, expected in plain.items():
        got, expected = weights[name].float().cpu(), expected.float().cpu()
        assert (got - expected).abs().max() <= lr * steps, name
        keys = _key_bias(name)
        if keys.stop:
            got, expected = torch.cat([got[: keys.start], got[keys.stop :]]), torch.cat([expected[: keys.start], expected[keys.stop :]])
        out[name] = float((got - expected).abs().max())
        far += int((~torch.isclose(got, expected, rtol=rtol, atol=atol)).sum())
        count += got.numel()
    assert far <= outliers * count, f"{far} of {count} elements differ by more than rtol={rtol}, atol={atol}: {sorted(out.items(), key=lambda kv: -kv[1])[:3]}"
    return out


@pytest.fixture(scope="module")
def plain_on_gpu(tmp_path_factory):
    return {precision: train("auto", tmp_path_factory.mktemp(f"plain-{precision}"), epochs=2, make_model=gpt2_4l, accelerator="gpu", precision=precision)
            for precision in ("32-true", "bf16-mixed", "16-mixed")}


# every preset in fp32 and bf16-mixed; fp16 with loss scaling (the GradScaler beside the host
# updates) on presets that update during backward, after it, and from NVMe
CASES = [(n, p) for n in PRESETS if n != "none" for p in ("32-true", "bf16-mixed")] + [(n, "16-mixed") for n in ("auto", "zero3_offload", "zero_infinity")]


@pytest.mark.parametrize(("name", "precision"), CASES)
def test_every_preset_on_a_gpu_trains_as_plain(name, precision, plain_on_gpu, tmp_path, record_property):
    """Each preset on the real CUDA path (pinned slabs, copy streams, NVMe files, DHA views where the
    preset asks for them), beside plain Lightning on the same GPU. fp32: equal to float32 rounding
    (cuBLAS may choose other kernels for other memory layouts). Mixed precision: both keep fp32
    masters and run the same autocast ops, so only kernel choice can differ; 16-bit rounding (2**-8
    in bf16) of one matmul that chose another kernel moves a loss by ~1e-3 at most over 12 steps."""
    total = param_bytes(gpt2_4l)
    policy = PolicyConfig.coerce(name)
    # the planned presets' first steps hold their profiling layout (the first block kept while the
    # others recompute): on an H200 the least layout alone needed 579 KiB of the 508 first given
    gpu = int((1.1 if name == "zero_offload" else 0.5) * total) + {"auto": 640_000, "lohan": 640_000, "teraio": 800_000}.get(policy.activations, 0)
    strategy = TieredStrategy(policy=name, gpu_memory=gpu, host_memory=int(6 * total), nvme_path=tmp_path / "nvme", nvme_memory="64MiB")
    where = Where()
    losses, weights, _ = train(strategy, tmp_path / "run", epochs=2, make_model=gpt2_4l, accelerator="gpu", precision=precision, extra_callbacks=(where,))
    plain_losses, plain_weights, _ = plain_on_gpu[precision]
    record_property("losses", [losses, plain_losses])
    record_property("metrics", {k: v for k, v in strategy.metrics().items() if k.startswith(("units/", "link/", "optimizer/"))})
    assert where.arena == "cuda" and not where.updated_twice
    rel, atol = (1e-5, 1e-5) if precision == "32-true" else (2e-3, 1e-3)
    assert losses == pytest.approx(plain_losses, rel=rel)
    # bf16-mixed: a weight one rounding apart may round to another bf16 value in the forward, moving
    # its gradient by up to 2**-8 relative, which Adam turns into up to a step for near-zero gradients
    diffs = _weight_differences(weights, plain_weights, 10 * rel, atol, steps=len(losses), lr=1e-2, outliers=0.0 if precision == "32-true" else 1e-3)
    record_property("max_weight_diffs", sorted(diffs.items(), key=lambda kv: -kv[1])[:3])


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_a_gan_stepping_twice_in_its_training_step_on_a_gpu_trains_as_plain(tmp_path, placement):
    """Manual optimization: the critic runs forward again after its step (and its weights are
    clipped through ``.data``); those forwards must compute with GPU-tier copies. The first loss
    holds the generator's loss through the critic just updated: a stale copy would move it by the
    update's size, ~1e-2. Later losses follow the host's RMSprop, which rounds differently from
    CUDA's: every critic weight one rounding apart after the first step moves them by 8e-5
    relative on the CPU (measured with ``torch.nextafter``), 7.5e-5 measured on an H200."""
    from tests import test_recipes as recipes

    plain_losses, _, _ = recipes.fit("auto", tmp_path / "plain", recipes.WeightClippingWgan, accelerator="gpu")
    losses, _, _ = recipes.fit(recipes.tiered(placement, tmp_path), tmp_path / "tiered", recipes.WeightClippingWgan, accelerator="gpu")
    assert losses[0] == pytest.approx(plain_losses[0], rel=1e-6)
    assert losses == pytest.approx(plain_losses, rel=3e-4)


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_a_callback_running_the_model_between_steps_on_a_gpu(tmp_path, placement):
    """A forward outside the steps (a callback logging predictions) computes with GPU-tier copies,
    not with the homes' host tensors."""
    from tests import test_recipes as recipes

    plain_losses, _, _ = recipes.fit("auto", tmp_path / "plain", recipes.Net, callbacks=(recipes.ForwardInCallback(),), accelerator="gpu")
    seen = recipes.ForwardInCallback()
    losses, _, _ = recipes.fit(recipes.tiered(placement, tmp_path), tmp_path / "tiered", recipes.Net, callbacks=(seen,), accelerator="gpu")
    assert all(seen.in_gpu_tier) and all(seen.home_after)
    assert losses == pytest.approx(plain_losses, rel=1e-5)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_hooks_see_every_gradient_on_a_gpu(tmp_path, placement, precision):
    """``on_before_optimizer_step`` reads ``p.grad`` of every parameter, offloaded ones included, as
    on the CPU (where the homes and the parameters share a device)."""
    from tests import test_recipes as recipes

    plain, tiered = recipes.FirstGradients(), recipes.FirstGradients()
    recipes.fit("auto", tmp_path / "plain", recipes.Net, steps=1, callbacks=(plain,), accelerator="gpu", precision=precision)
    recipes.fit(recipes.tiered(placement, tmp_path), tmp_path / "tiered", recipes.Net, steps=1, callbacks=(tiered,), accelerator="gpu", precision=precision)
    missing = [name for name, grad in tiered.seen.items() if grad is None]
    assert not missing, f"hooks found no gradient for {missing}"
    for name, grad in plain.seen.items():
        torch.testing.assert_close(tiered.seen[name].float().cpu(), grad.float().cpu(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make", ["ClipsItsOwnGradients", "GradientsByHand"])
@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_manual_optimization_handling_its_own_gradients_on_a_gpu(tmp_path, placement, make):
    """After ``manual_backward`` offloaded gradients are at home in host memory while the
    parameters are on the GPU: the training step's code reads and clips them through views of
    the homes; gradients it sets by hand are taken home before the step."""
    from tests import test_recipes as recipes

    module = getattr(recipes, make)
    plain_losses, _, plain = recipes.fit("auto", tmp_path / "plain", module, accelerator="gpu")
    losses, _, model = recipes.fit(recipes.tiered(placement, tmp_path), tmp_path / "tiered", module, accelerator="gpu")
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    assert getattr(model, "norms", []) == pytest.approx(getattr(plain, "norms", []), rel=1e-5)


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_gradients_taken_outside_the_training_step_on_a_gpu(tmp_path, placement):
    """An adversarial attack in validation and input gradients in a callback, with units evicted
    in every forward: the backward fetches them again (on a GPU a parameter left at its home
    would be a host tensor)."""
    from tests import test_recipes as recipes

    kwargs = dict(steps=4, limit_val_batches=1, val_check_interval=2, accelerator="gpu")
    plain_cb, tiered_cb = recipes.InputGradients(), recipes.InputGradients()
    plain_losses, _, plain = recipes.fit("auto", tmp_path / "plain", recipes.AdversarialValidation, callbacks=(plain_cb,), **kwargs)
    losses, _, model = recipes.fit(recipes.streamed(placement, tmp_path), tmp_path / "tiered", recipes.AdversarialValidation, callbacks=(tiered_cb,), **kwargs)
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    assert [x for t in model.seen for x in t] == pytest.approx([x for t in plain.seen for x in t], rel=1e-4)
    assert [x for t in tiered_cb.seen for x in t] == pytest.approx([x for t in plain_cb.seen for x in t], rel=1e-4)


def test_fabric_on_a_gpu_trains_as_plain():
    from offload_strategy import TieredFabricStrategy
    from tests.test_fabric import fabric_train

    plain_losses, plain_weights, _ = fabric_train("auto", accelerator="cuda")
    losses, weights, fabric = fabric_train(TieredFabricStrategy(policy=PARAMETERS_ONLY, gpu_memory="256KiB"), accelerator="cuda")
    assert fabric.strategy.metrics()["units/host"] > 0
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    _weight_differences(weights, plain_weights, 1e-4, 1e-5, steps=len(losses), lr=1e-2)


def test_tiered_ddp_on_nccl_trains_as_ddp(tmp_path):
    """One rank on NCCL: the process group, the reductions of offloaded units' gradients and the
    sharded states run their CUDA path."""
    from offload_strategy import TieredDDPStrategy

    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("ddp", tmp_path / "plain", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    strategy = TieredDDPStrategy(policy=PARAMETERS_ONLY, gpu_memory=int(0.3 * total), host_memory="1GiB", process_group_backend="nccl")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    _weight_differences(weights, plain_weights, 1e-4, 1e-5, steps=len(losses), lr=1e-2)


def test_the_chunked_loss_on_a_gpu_trains_as_plain_and_holds_less(tmp_path):
    """A GPT-2 with a 32,000-token vocabulary: its own loss holds the fp32 logits of the 64
    tokens (7.8 MiB) and more in CUDA memory; a loss 8 tokens at a time does not, and trains
    under ``tiered`` (every unit streamed, and under the default policy) as plain Lightning does."""
    from tests.helpers import TINY_GPT2

    config = dict(TINY_GPT2, vocab_size=32000)

    def model(chunk):
        return lambda: CausalLM(family="gpt2", config=config, lr=1e-2, warmup_steps=2, loss_chunk_tokens=chunk)

    peaks = {}
    for chunk in (None, 8):
        torch.cuda.reset_peak_memory_stats()
        losses, weights, _ = train("auto", tmp_path / f"plain{chunk}", epochs=1, make_model=model(chunk), accelerator="gpu")
        peaks[chunk] = torch.cuda.max_memory_allocated()
        if chunk is not None:
            plain_losses, plain_weights = losses, weights
    assert peaks[None] - peaks[8] >= 64 * 32000 * 4, peaks
    for strategy in (TieredStrategy(policy={"placement": "host", "activations": "keep"}, gpu_memory="16MiB", host_memory="1GiB"),
                     TieredStrategy(gpu_memory="64MiB", host_memory="1GiB")):
        losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=model(8), accelerator="gpu")
        assert losses == pytest.approx(plain_losses, rel=1e-5)
        _weight_differences(weights, plain_weights, 1e-4, 1e-5, steps=len(losses), lr=1e-2)


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_gradients_of_parameters_unfrozen_inside_a_step_land_in_pinned_memory_on_a_gpu(tmp_path, placement):
    """The gradient homes of a weight unfrozen beside its trainable bias and of a block frozen whole
    at set-up are pinned (the slab's, the overflow's), so their copies out of the GPU tier are
    asynchronous; training matches plain on the same GPU (``tests/test_pinned_gradients.py``)."""
    import lightning as L

    from offload_strategy.planning.placement import GPU
    from tests import test_recipes as recipes
    from tests.test_pinned_gradients import UnfreezeInStep

    homes: list[bool] = []

    class Homes(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            engine = trainer.strategy.engine
            if batch_idx == 2:  # the step that unfroze them, before the model is placed again
                homes.extend(r.home.is_pinned() for s in engine.states if s.home != GPU for r in s.grads if r.home is not None)

    plain_losses, _, _ = recipes.fit("auto", tmp_path / "plain", UnfreezeInStep, steps=4, accelerator="gpu")
    losses, _, _ = recipes.fit(recipes.tiered(placement, tmp_path), tmp_path / "tiered", UnfreezeInStep, steps=4, callbacks=(Homes(),), accelerator="gpu")
    assert homes and all(homes), homes
    assert losses == pytest.approx(plain_losses, rel=1e-5)
