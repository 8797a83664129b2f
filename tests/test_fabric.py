"""The tiered strategy under Lightning Fabric: the user's own loop (forward, ``fabric.backward``,
clipping, accumulation, ``optimizer.step``) trains to the bit what plain Fabric trains, with the
parameters at home in host memory or on NVMe, and ``fabric.save`` / ``fabric.load`` resume exactly."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Union

import lightning as L
import pytest
import torch
from torch import nn

from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.strategies import SingleDeviceStrategy

import offload_strategy
from offload_strategy.demos import build_causal_lm
from offload_strategy import TieredFabricStrategy
from offload_strategy.config import parse_size
from tests.helpers import TINY_GPT2
from tests.test_offload import GPT2_4L

SEQ, BATCH = 16, 4


def beside_kept(share: str, peak: str = "661KiB") -> int:
    """A GPU tier that leaves the parameters ``share`` beside the fixed layout's ``peak`` of
    activations (measured in the first step; the tiny GPT-2's two kept blocks in fp32 by default),
    where they are placed again after that step."""
    return parse_size(share) + parse_size(peak)


def _batches(count: int, seed: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (BATCH, SEQ), generator=generator) for _ in range(count)]


def _model(config: Optional[dict] = None) -> nn.Module:
    torch.manual_seed(0)
    return build_causal_lm("gpt2", config or TINY_GPT2)  # tied input and output embeddings


def fabric_train(
    strategy: Union[str, L.fabric.strategies.Strategy], steps: int = 5, *, accumulate: int = 1, max_norm: Optional[float] = None,
    clip_val: Optional[float] = None, precision: str = "32-true", save: Optional[Path] = None, load: Optional[Path] = None, accelerator: str = "cpu",
    config: Optional[dict] = None,
) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    """The loop a Fabric user writes; returns the losses, the final weights and the Fabric object."""
    fabric = L.Fabric(accelerator=accelerator, devices=1, strategy=strategy, precision=precision)
    model = _model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if load is not None:
        fabric.load(load, state)
    batches = _batches(steps * accumulate)
    losses = []
    for step in range(state["step"], steps):
        for micro in range(accumulate):
            batch = fabric.to_device(batches[step * accumulate + micro])
            loss = model(input_ids=batch, labels=batch).loss / accumulate
            fabric.backward(loss)
            losses.append(loss.item())
        if max_norm is not None:
            fabric.clip_gradients(model, optimizer, max_norm=max_norm)
        if clip_val is not None:
            fabric.clip_gradients(model, optimizer, clip_val=clip_val)
        optimizer.step()
        optimizer.zero_grad()
        if save is not None and step == 1:
            state["step"] = step + 1
            fabric.save(save, state)
    fabric.strategy.teardown()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, fabric


def assert_same(plain: tuple, tiered: tuple) -> None:
    assert tiered[0] == plain[0], "losses differ from plain Fabric's"
    assert plain[1].keys() == tiered[1].keys()
    for name, value in plain[1].items():
        assert torch.equal(value, tiered[1][name]), name


@pytest.mark.parametrize(
    "recipe", [dict(), dict(max_norm=0.05), dict(clip_val=0.01), dict(accumulate=2, max_norm=0.05)], ids=["plain", "norm", "value", "accumulate"]
)
def test_same_losses_and_weights_as_plain_fabric_from_host_memory(recipe):
    strategy = TieredFabricStrategy(policy="zero3_offload", gpu_memory=beside_kept("160KiB"))
    tiered = fabric_train(strategy, **recipe)
    assert strategy.metrics()["link/h2d_bytes_total"] > 0, "nothing was streamed"
    assert_same(fabric_train("auto", **recipe), tiered)


def test_same_losses_and_weights_as_plain_fabric_from_nvme(tmp_path):
    strategy = TieredFabricStrategy(policy="zero_infinity", gpu_memory=beside_kept("160KiB"), nvme_path=tmp_path / "nvme")
    tiered = fabric_train(strategy, max_norm=0.05)
    assert strategy.metrics()["link/nvme_read_bytes_total"] > 0, "nothing was read from NVMe"
    assert_same(fabric_train("auto", max_norm=0.05), tiered)


def test_the_default_policy_plans_placement_and_activations_and_stays_exact():
    """``policy="auto"`` profiles the first step, then places the parameters and chooses every
    block's activation policy between steps, as under the Trainer."""
    strategy = TieredFabricStrategy(gpu_memory="675KiB")
    tiered = fabric_train(strategy, steps=4, max_norm=0.05, config=GPT2_4L)
    assert strategy.placement_search is not None, "the placement search did not run"
    plan = strategy.activation_plan
    # the blocks' activations do not all fit beside the parameters: one at least is recomputed or swapped
    assert plan is not None and len(plan.layout) == GPT2_4L["n_layer"] and set(plan.layout) != {"keep"}, plan
    assert_same(fabric_train("auto", steps=4, max_norm=0.05, config=GPT2_4L), tiered)


def test_clip_gradients_by_norm_returns_plain_fabrics_total_norm():
    norms = {}
    for name, strategy in [("plain", "auto"), ("tiered", TieredFabricStrategy(policy="zero3_offload", gpu_memory=beside_kept("160KiB")))]:
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
        model, optimizer = fabric.setup(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
        batch = _batches(1)[0]
        fabric.backward(model(input_ids=batch, labels=batch).loss)
        norms[name] = fabric.clip_gradients(model, optimizer, max_norm=1e-3)
        fabric.strategy.teardown()
    assert torch.equal(norms["plain"], norms["tiered"])


def test_save_and_load_resume_exactly(tmp_path):
    straight = fabric_train(TieredFabricStrategy(policy="zero3_offload", gpu_memory=beside_kept("160KiB")), steps=4)
    fabric_train(TieredFabricStrategy(policy="zero3_offload", gpu_memory=beside_kept("160KiB")), steps=2, save=tmp_path / "ckpt.pt")
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert checkpoint["step"] == 2 and "transformer.h.0.attn.c_attn.weight" in checkpoint["model"]
    resumed = fabric_train(TieredFabricStrategy(policy="zero3_offload", gpu_memory=beside_kept("160KiB")), steps=4, load=tmp_path / "ckpt.pt")
    assert resumed[0] == straight[0][2:]
    for name, value in straight[1].items():
        assert torch.equal(value, resumed[1][name]), name
    # and plain Fabric resumes from the tiered checkpoint to the same weights
    plain = fabric_train("auto", steps=4, load=tmp_path / "ckpt.pt")
    assert_same(plain, resumed)


def test_evaluation_without_gradients_reads_the_trained_weights():
    strategy = TieredFabricStrategy(policy="zero3_offload", gpu_memory=beside_kept("160KiB"))
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    plain_model = _model()
    model, _ = fabric.setup(_model(), torch.optim.SGD(plain_model.parameters(), lr=0.0))
    batch = _batches(1)[0]
    model.eval()
    with torch.no_grad():
        tiered = model(input_ids=batch).logits
        expected = plain_model.eval()(input_ids=batch).logits
    assert torch.equal(tiered, expected)
    assert strategy.metrics()["link/h2d_bytes_total"] > 0
    fabric.strategy.teardown()


def test_the_strategy_is_known_to_fabric_by_name_with_every_preset():
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="tiered")
    assert isinstance(fabric.strategy, TieredFabricStrategy) and fabric.strategy.policy.name == "auto"
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="tiered_zero_offload")
    assert fabric.strategy.policy.placement == "offload_states"
    names = {f"tiered_{p}" for p in offload_strategy.PRESETS if p not in ("auto", "none")}
    assert names <= set(L.fabric.strategies.STRATEGY_REGISTRY)


def test_refusals_say_what_to_do():
    scaled = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))  # what '16-mixed' is on a GPU
    with pytest.raises(ValueError, match="16-mixed.*bf16-mixed"):
        TieredFabricStrategy(precision=scaled)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="tiered")
    model = fabric.setup_module(_model())
    with pytest.raises(RuntimeError, match=r"fabric\.setup\(model, optimizer\)"):
        fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.strategy.teardown()
    with pytest.raises(ValueError, match="devices=1"):
        L.Fabric(accelerator="cpu", devices=2, strategy=TieredFabricStrategy())


def test_bf16_mixed_matches_plain_fabric():
    tiered = fabric_train(TieredFabricStrategy(policy="zero3_offload", gpu_memory=beside_kept("160KiB", "497KiB")), steps=3, max_norm=0.05, precision="bf16-mixed")
    assert_same(fabric_train("auto", steps=3, max_norm=0.05, precision="bf16-mixed"), tiered)


def test_bf16_true_updates_fp32_masters_as_a_hand_written_loop_does():
    """Under bf16-true the tiered runtime updates an fp32 master of each parameter (as the Trainer's
    strategy does); the reference is plain Fabric with the masters kept by hand."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="auto", precision="bf16-true")
    model = fabric.setup(_model())
    params = [p for p in model.parameters()]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    losses = []
    for batch in _batches(3):
        loss = model(input_ids=batch, labels=batch).loss
        fabric.backward(loss)
        losses.append(loss.item())
        for p, master in zip(params, masters):
            master.grad = p.grad.float()
            p.grad = None
        optimizer.step()
        with torch.no_grad():
            for p, master in zip(params, masters):
                p.copy_(master)
    reference = (losses, {k: v.detach().clone() for k, v in model.state_dict().items()})
    tiered = fabric_train(TieredFabricStrategy(policy="zero3_offload", gpu_memory=beside_kept("80KiB", "428KiB")), steps=3, precision="bf16-true")
    assert all(v.dtype == torch.bfloat16 for v in tiered[1].values())
    assert_same(reference, tiered)


def test_a_script_that_never_tears_the_strategy_down_still_exits_and_cleans_up(tmp_path):
    """Fabric has no end of training: a loop that ends without ``fabric.strategy.teardown()`` must
    neither hang at exit (the runtime's threads are daemons) nor leave its NVMe files behind."""
    script = tmp_path / "loop.py"
    script.write_text(
        "import torch, lightning as L\n"
        "from offload_strategy import TieredFabricStrategy\n"
        "m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])\n"
        f"s = TieredFabricStrategy(policy='zero_infinity', gpu_memory='56KiB', nvme_path={str(tmp_path / 'nvme')!r})\n"
        "fabric = L.Fabric(accelerator='cpu', devices=1, strategy=s)\n"
        "model, opt = fabric.setup(m, torch.optim.AdamW(m.parameters(), lr=1e-2))\n"
        "for _ in range(3):\n"
        "    fabric.backward(model(torch.randn(8, 64)).pow(2).mean()); opt.step(); opt.zero_grad()\n"
        "print('trained', s.metrics()['link/nvme_read_bytes_total'] > 0)\n"
    )
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "trained True" in result.stdout, result.stderr[-2000:]
    assert not [p for p in (tmp_path / "nvme").rglob("*") if p.is_file()], "NVMe files left behind"


def _linear_stack(strategy, step: Callable[..., Optional[float]], steps: int, init_module: bool = False) -> tuple[list[float], list[torch.Tensor], int]:
    """Six linear layers and AdamW set up under ``strategy`` and trained by the loop's body
    ``step(fabric, model, optimizer, batch, index)`` (``batch()`` draws the next one; it returns
    the loss, or None for a skipped batch): the losses, the final weights, and how many parameters
    were built without memory (under ``fabric.init_module()`` with ``init_module``)."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    torch.manual_seed(0)
    with fabric.init_module() if init_module else contextlib.nullcontext():
        module = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    deferred = len(strategy.tiered.deferred) if isinstance(strategy, TieredFabricStrategy) else 0
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(1)
    losses = [step(fabric, model, optimizer, lambda: torch.randn(8, 64, generator=generator), i) for i in range(steps)]
    fabric.strategy.teardown()
    return [loss for loss in losses if loss is not None], [p.detach().clone() for p in module.parameters()], deferred


def _plain_step(fabric, model, optimizer, batch, index: int) -> float:
    loss = model(batch()).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _two_forwards(fabric, model, optimizer, batch, index: int) -> float:
    loss = model(batch()).pow(2).mean() + model(batch()).pow(2).mean()  # two forwards, one backward (a contrastive pair)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _skipping_odd_batches(fabric, model, optimizer, batch, index: int) -> Optional[float]:
    loss = model(batch()).pow(2).mean()
    fabric.backward(loss)
    if index % 2:  # a batch the loop skips (a non-finite loss, say): its gradients are discarded
        optimizer.zero_grad()
        return None
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _tiered() -> TieredFabricStrategy:
    return TieredFabricStrategy(policy="zero3_offload", gpu_memory=beside_kept("40KiB", "16KiB"))


def assert_same_run(plain: tuple, tiered: tuple) -> None:
    assert tiered[0] == plain[0], "losses differ from plain Fabric's"
    assert all(torch.equal(a, b) for a, b in zip(plain[1], tiered[1], strict=True))


def test_two_forwards_before_one_backward_train_as_plain_fabric_does():
    assert_same_run(_linear_stack("auto", _two_forwards, 4), _linear_stack(_tiered(), _two_forwards, 4))


def test_a_second_model_is_refused_with_how_to_tier_both():
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=TieredFabricStrategy(policy="zero3_offload", gpu_memory=beside_kept("40KiB", "16KiB")))
    first, second = nn.Linear(64, 64), nn.Linear(64, 64)
    fabric.setup(first, torch.optim.SGD(first.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="one model.*nn.ModuleDict"):
        fabric.setup(second, torch.optim.SGD(second.parameters(), lr=0.1))
    fabric.strategy.teardown()


def test_a_model_built_under_fabric_init_module_is_computed_in_its_homes_to_the_bit():
    plain = _linear_stack(SingleDeviceStrategy(device="cpu"), _plain_step, 3, init_module=True)
    tiered = _linear_stack(_tiered(), _plain_step, 3, init_module=True)
    assert tiered[2] == 12, "the parameters were allocated when built"
    assert_same_run(plain, tiered)


def test_zero_grad_between_backward_and_step_discards_gradients_at_home_too():
    """Fabric's optimizer wrapper calls the class's zero_grad: it sets the gradients exposed on
    ``.grad`` to None, and the next backward drops them at home too (before, they were added to
    the next batch's)."""
    assert_same_run(_linear_stack("auto", _skipping_odd_batches, 5), _linear_stack(_tiered(), _skipping_odd_batches, 5))


@pytest.mark.parametrize("placement", ["host", "nvme"])
@pytest.mark.parametrize("how", ["in-place", "torch-clip"])
def test_gradients_the_loop_changes_between_backward_and_the_step(tmp_path, placement, how):
    """The user's loop reads and changes ``p.grad`` after ``fabric.backward`` (halving it in place,
    or torch's own ``clip_grad_norm_`` over the parameters): offloaded gradients used to be away
    from ``p.grad`` there, so the loop changed nothing and trained on."""

    def train(strategy: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
        model, optimizer = fabric.setup(*(lambda m: (m, torch.optim.AdamW(m.parameters(), lr=1e-2)))(_model()))
        losses = []
        for batch in _batches(4):
            loss = model(input_ids=batch, labels=batch).loss
            fabric.backward(loss)
            losses.append(loss.item())
            if how == "in-place":
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()
        fabric.strategy.teardown()
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    policy = dict(policy="zero_infinity", nvme_path=tmp_path / "nvme") if placement == "nvme" else dict(policy="zero3_offload")
    assert_same(train("auto"), train(TieredFabricStrategy(gpu_memory=beside_kept("160KiB"), **policy)))
