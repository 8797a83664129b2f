"""Training recipes users bring, each trained side by side with plain Lightning: the same losses
and weights bit for bit (fp32, CPU) with units streamed from host memory and from NVMe, or a
refusal at set-up that names the recipe and what to do."""

from __future__ import annotations

import collections
import contextlib
from pathlib import Path
from typing import Any, Callable, Optional
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint
from lightning.pytorch.strategies import Strategy
from torch import nn

from offload_strategy import TieredStrategy
from tests.helpers import assert_same_weights, tiny_data

PLACEMENTS = ("host", "nvme")


def tiered(placement: str, root: Path, gpu_memory: str = "1MiB", **policy: Any) -> TieredStrategy:
    """Every unit streamed through a 1 MiB GPU tier from its home: host memory or NVMe."""
    nvme = {"nvme_path": str(root / "nvme"), "nvme_memory": "1GiB"} if placement == "nvme" else {}
    return TieredStrategy(policy={"placement": placement, "activations": "keep", **policy}, gpu_memory=gpu_memory, host_memory="1GiB", **nvme)


PLACEMENTS_16_BIT = {"host": lambda root: tiered("host", root), "nvme": lambda root: tiered("nvme", root),
                     "resident": lambda root: TieredStrategy(gpu_memory="64MiB", host_memory="1GiB")}  # every unit persistent


class Net(L.LightningModule):
    """Embedding, four residual blocks, a norm and a head; AdamW over two param groups."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 256)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x = self.embed(batch[:, :-1])
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(self.norm(x))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch).flatten(0, 1), batch[:, 1:].flatten())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2 and p.requires_grad]
        rest = [p for p in self.parameters() if p.dim() < 2 and p.requires_grad]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) and "loss" in outputs else pl_module.last_loss
        self.values.append(float(loss.detach()))


def fit(
    strategy: Any, root: Path, make: Callable[[], L.LightningModule], steps: int = 6, callbacks: tuple = (), accelerator: str = "cpu",
    **trainer_kwargs: Any,
) -> tuple[list[float], dict[str, torch.Tensor], L.LightningModule]:
    L.seed_everything(7, verbose=False)
    model = make()
    losses = Losses()
    trainer = L.Trainer(
        strategy=strategy, accelerator=accelerator, devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=root, callbacks=[losses, *callbacks], **{"limit_val_batches": 0, **trainer_kwargs},
    )
    trainer.fit(model, datamodule=tiny_data())
    return losses.values, {k: v.detach().clone() for k, v in model.state_dict().items()}, model


class PlainRuns:
    """Plain Lightning's runs that several tests of a module compare with, each run once per model,
    step count and trainer settings (seeded alike, a second run would give the same losses and
    weights); runs with callbacks are not kept, their callbacks' state being the test's."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple, tuple[list[float], dict[str, torch.Tensor], L.LightningModule]] = {}

    def __call__(self, make: Callable[[], L.LightningModule], steps: int = 6, **trainer_kwargs: Any) -> tuple[list[float], dict[str, torch.Tensor], L.LightningModule]:
        key = (make, steps, tuple(sorted(trainer_kwargs.items())))
        if key not in self.done:
            self.done[key] = fit("auto", self.root / f"plain{len(self.done)}", make, steps=steps, **trainer_kwargs)
        return self.done[key]


def assert_like_plain(tmp_path: Path, placement: str, make: Callable[[], L.LightningModule], callbacks: Callable[[], tuple] = tuple,
                      policy: Optional[dict] = None, **kwargs: Any) -> tuple[L.LightningModule, L.LightningModule]:
    plain_losses, plain_weights, plain = fit("auto", tmp_path / "plain", make, callbacks=callbacks(), **kwargs)
    losses, weights, model = fit(tiered(placement, tmp_path, **(policy or {})), tmp_path / "tiered", make, callbacks=callbacks(), **kwargs)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    return plain, model


# -- optimizers -----------------------------------------------------------------------------------


class TwoOptimizers(Net):
    """Manual optimization: AdamW for the body, SGD for the head, both stepped after one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        body, head = self.optimizers()
        body.zero_grad()
        head.zero_grad()
        self.last_loss = self.loss(batch)
        self.manual_backward(self.last_loss)
        body.step()
        if self.head_steps(batch_idx):
            head.step()

    def head_steps(self, batch_idx: int) -> bool:
        return True

    def configure_optimizers(self):
        body = [p for name, p in self.named_parameters() if not name.startswith("head")]
        return torch.optim.AdamW(body, lr=1e-2), torch.optim.SGD(self.head.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_two_optimizers_stepped_after_one_backward(tmp_path, placement):
    plain, model = assert_like_plain(tmp_path, placement, TwoOptimizers)
    assert not torch.equal(model.head.weight, TwoOptimizers().head.weight)


class GanStyle(TwoOptimizers):
    """The second optimizer steps every other batch, but both zero their gradients every batch."""

    def head_steps(self, batch_idx: int) -> bool:
        return bool(batch_idx % 2)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_zero_grad_of_an_optimizer_that_did_not_step_drops_its_gradients(tmp_path, placement):
    assert_like_plain(tmp_path, placement, GanStyle)


class MuonAndAdamW(TwoOptimizers):
    """Manual optimization as Muon is used: Muon for the blocks' weight matrices, AdamW for the
    rest, so that each block's weight and bias (one unit) are in different optimizers."""

    def configure_optimizers(self):
        matrices = [p for n, p in self.named_parameters() if n.startswith("blocks") and p.dim() == 2]
        rest = [p for n, p in self.named_parameters() if not (n.startswith("blocks") and p.dim() == 2)]
        return torch.optim.Muon(matrices, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_unit_whose_parameters_two_optimizers_step(tmp_path, placement):
    # each optimizer's states of one NVMe unit used to share one file: the second overwrote the
    # first's layout, whose states were then read as NaN from the third step on
    assert_like_plain(tmp_path, placement, MuonAndAdamW)


def _resume_from_step_4(strategy: Any, resume_strategy: Any, root: Path, precision: str) -> dict[str, torch.Tensor]:
    kwargs: dict[str, Any] = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                                  num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root, precision=precision)
    L.seed_everything(7, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=2)
    L.Trainer(strategy=strategy, max_steps=4, callbacks=[checkpoints], **kwargs).fit(MuonAndAdamW(), datamodule=tiny_data())
    L.seed_everything(7, verbose=False)
    model = MuonAndAdamW()
    L.Trainer(strategy=resume_strategy, max_steps=8, enable_checkpointing=False, **kwargs).fit(
        model, datamodule=tiny_data(), ckpt_path=str(root / "ckpt" / "last.ckpt"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_unit_two_optimizers_step_resumes_on_nvme_with_its_fp32_masters(tmp_path):
    """Under bf16-true the fp32 masters are stored with the states: both optimizers' masters and
    states of a unit come back from the checkpoint into its one NVMe file (host memory agrees)."""
    host = _resume_from_step_4(tiered("host", tmp_path / "h1"), tiered("host", tmp_path / "h2"), tmp_path / "host", "bf16-true")
    nvme = _resume_from_step_4(tiered("nvme", tmp_path / "n1"), tiered("nvme", tmp_path / "n2"), tmp_path / "nvme", "bf16-true")
    assert_same_weights(host, nvme)


class MatricesOnly(Net):
    """One optimizer over the blocks' weight matrices; the biases, embedding, norm and head still
    require gradients but nothing steps them (their gradients add up, as in plain training)."""

    def configure_optimizers(self):
        return torch.optim.AdamW([p for n, p in self.named_parameters() if n.startswith("blocks") and p.dim() == 2], lr=1e-2)


def test_parameters_no_optimizer_steps_beside_ones_it_does_on_nvme(tmp_path):
    # a unit updated during backward stayed counted as on the worker while a bias no optimizer
    # steps held its gradient buffer, so the next backward waited for it forever
    plain, model = assert_like_plain(tmp_path, "nvme", MatricesOnly)
    L.seed_everything(7, verbose=False)
    initial = MatricesOnly()
    assert torch.equal(model.blocks[0].bias, initial.blocks[0].bias) and not torch.equal(model.blocks[0].weight, initial.blocks[0].weight)


class WithScale(Net):
    """A free-standing tensor the model does not register, given to the optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones((), requires_grad=True)

    def forward(self, batch):
        return super().forward(batch) * self.scale

    def configure_optimizers(self):
        return torch.optim.AdamW([*self.parameters(), self.scale], lr=1e-2)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_tensor_the_model_does_not_register_is_updated(tmp_path, placement):
    plain, model = assert_like_plain(tmp_path, placement, WithScale)
    assert model.scale.item() == plain.scale.item() != 1.0



class LogitScale(Net):
    """A 0-d parameter (CLIP's learned temperature), read as an attribute in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, batch):
        return super().forward(batch) * self.logit_scale


def test_a_0_d_parameter_on_nvme(tmp_path):
    plain, model = assert_like_plain(tmp_path, "nvme", LogitScale)
    assert model.logit_scale.item() == plain.logit_scale.item() != 2.0

class PlainSGD(Net):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_optimizer_without_state_on_nvme(tmp_path):
    assert_like_plain(tmp_path, "nvme", PlainSGD)


class AmsgradAdamW(Net):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, amsgrad=True)


class CenteredRMSprop(Net):
    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters(), lr=1e-3, centered=True, momentum=0.9)


@pytest.mark.parametrize("make", [AmsgradAdamW, CenteredRMSprop])
def test_optimizers_keeping_three_states_a_parameter_on_nvme(tmp_path, make):
    """AdamW with amsgrad and RMSprop centered with momentum keep three states per parameter where
    their classes usually keep two and one: the NVMe update buffers were sized for those and the
    first update failed (no slot can hold the states). The factor is now measured on a stand-in."""
    from offload_strategy.runtime.updates.optimizers import measured_state_factor

    assert measured_state_factor(make().configure_optimizers()) == 3.0
    assert_like_plain(tmp_path, "nvme", make)


def test_the_state_factor_is_measured_per_param_group():
    """The most any group keeps: plain SGD none, SGD with momentum one, Adafactor's factored
    moments a fraction (per row and column of a 64 x 64 stand-in); a class that cannot be stepped
    on a stand-in gives None (the usual count is used)."""
    from offload_strategy.runtime.updates.optimizers import measured_state_factor

    w, b = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))
    assert measured_state_factor(torch.optim.SGD([w], lr=0.1)) == 0.0
    assert measured_state_factor(torch.optim.SGD([{"params": [w]}, {"params": [b], "momentum": 0.9}], lr=0.1)) == 1.0
    assert 0 < measured_state_factor(torch.optim.Adafactor([w], lr=0.1)) < 0.1

    class ShapeBound(ScaledStep):  # works only on the shapes it was built for
        def step(self, closure=None, scale=1.0):
            if any(p.shape != (4, 4) for group in self.param_groups for p in group["params"]):
                raise RuntimeError("built for 4 x 4 weights")
            return super().step(closure, scale)

    assert measured_state_factor(ShapeBound([w], lr=0.1)) is None


class ScaledStep(torch.optim.Optimizer):
    """Per-parameter SGD defined outside torch, with a keyword its step takes."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None, scale=1.0):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * scale)


class StepKeywords(Net):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure, scale=0.5 if batch_idx % 2 else 2.0)

    def configure_optimizers(self):
        return ScaledStep(self.parameters())


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_keyword_arguments_of_optimizer_step_reach_every_unit(tmp_path, placement):
    assert_like_plain(tmp_path, placement, StepKeywords)


class GlobalNormSGD(torch.optim.Optimizer):
    """Couples parameters: every update is scaled by the norm of all gradients of the group."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / norm, alpha=-group["lr"])


class Coupled(Net):
    def configure_optimizers(self):
        return GlobalNormSGD(self.parameters())


class PerParameterCustom(Net):
    def configure_optimizers(self):
        return ScaledStep(self.parameters())


def test_an_optimizer_that_couples_parameters_is_refused_at_set_up(tmp_path):
    with pytest.raises(ValueError, match=r"GlobalNormSGD couples parameters in its step.*per-parameter|GlobalNormSGD couples"):
        fit(tiered("host", tmp_path), tmp_path, Coupled)
    # a custom per-parameter one passes the same check and trains like plain
    assert_like_plain(tmp_path, "host", PerParameterCustom)


class NeedsClosure(torch.optim.Optimizer):
    """SAM-style: the step re-evaluates the model through its closure."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    def step(self, closure):
        with torch.enable_grad():
            return closure()


class ClosureOptimizer(Net):
    steps = 0

    def training_step(self, batch, batch_idx):
        ClosureOptimizer.steps += 1
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return NeedsClosure(self.parameters())


class Lbfgs(ClosureOptimizer):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


@pytest.mark.parametrize("make", [ClosureOptimizer, Lbfgs], ids=["requires-closure", "lbfgs"])
def test_optimizers_that_re_evaluate_the_model_are_refused_before_any_step(tmp_path, make):
    ClosureOptimizer.steps = 0
    with pytest.raises(ValueError, match=r"step requires a closure: it re-evaluates the whole model"):
        fit(tiered("host", tmp_path), tmp_path, make)
    assert ClosureOptimizer.steps == 0


# -- the trainable set changes ------------------------------------------------------------------


class UnfreezeInStep(Net):
    """Block 1 frozen at first, unfrozen inside the third training step (the optimizer has it)."""

    def configure_optimizers(self):
        self.blocks[1].requires_grad_(False)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            self.blocks[1].requires_grad_(True)
        return super().training_step(batch, batch_idx)


# layers unfrozen inside a training step, in both placements: tests/test_pinned_gradients.py


class Finetune(BaseFinetuning):
    """Blocks frozen before training, unfrozen with a param group of their own at epoch 1."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.blocks)

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.blocks, optimizer, lr=5e-3)


class FinetuneNet(Net):
    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_base_finetuning_unfreezes_and_adds_a_param_group(tmp_path, placement):
    plain, model = assert_like_plain(tmp_path, placement, FinetuneNet, callbacks=lambda: (Finetune(),), steps=9)
    assert len(model.trainer.optimizers[0].param_groups) == 2


def test_layers_unfrozen_past_a_gpu_tier_that_held_everything_frozen_are_placed_again(tmp_path):
    """Frozen, the blocks need no gradients or states and everything fits 300 KiB (278 KiB): no
    engine. Unfrozen at epoch 1 they need 327 KiB, and the run went on in the GPU tier past its
    budget, placing nothing; now the units are placed again once the step that unfroze them is done."""
    strategy = TieredStrategy(gpu_memory="300KiB", host_memory="1GiB")
    plain_losses, plain_weights, _ = fit("auto", tmp_path / "plain", FinetuneNet, callbacks=(Finetune(),), steps=9)
    losses, weights, model = fit(strategy, tmp_path / "tiered", FinetuneNet, callbacks=(Finetune(),), steps=9)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert strategy.metrics().get("units/host", 0) > 0, "nothing was offloaded once the blocks needed gradients and states"


class UnfreezeAtStart(L.Callback):
    def on_train_start(self, trainer, pl_module):
        pl_module.requires_grad_(True)


class AllFrozen(Net):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        self.requires_grad_(False)  # everything frozen when the strategy places the model
        return optimizer


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_model_frozen_at_set_up_trains_once_unfrozen(tmp_path, placement):
    assert_like_plain(tmp_path, placement, AllFrozen, callbacks=lambda: (UnfreezeAtStart(),))


class LateModule(Net):
    """A layer first used from the third step on."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(32, 32)

    def forward(self, batch):
        x = self.embed(batch[:, :-1])
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        if self.global_step >= 2:
            x = x + self.late(x)
        return self.head(self.norm(x))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_module_first_used_after_the_first_step(tmp_path, placement):
    assert_like_plain(tmp_path, placement, LateModule)


# -- user code between backward and the step ----------------------------------------------------


class ClipsItself(Net):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_modules_own_gradient_clipping_is_applied(tmp_path, placement):
    assert_like_plain(tmp_path, placement, ClipsItself)


class SeesTheStep(L.Callback):
    """What a gradient or weight logger reads right before each step."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        weights = sum(float(p.detach().double().sum()) for p in pl_module.parameters())
        grads = sum(float(p.grad.double().norm()) for p in pl_module.parameters() if p.grad is not None)
        self.seen.append((weights, grads))


def test_on_before_optimizer_step_sees_the_gradients_and_the_weights_before_the_update(tmp_path):
    seen = {}

    def callbacks() -> tuple:
        seen[len(seen)] = SeesTheStep()
        return (seen[len(seen) - 1],)

    assert_like_plain(tmp_path, "host", Net, callbacks=callbacks)
    assert seen[0].seen == seen[1].seen and seen[0].seen[0][1] > 0


def test_a_mock_that_wraps_strategy_backward_sees_every_backward(tmp_path):
    """Lightning's own tests count backward calls by patching ``Strategy.backward`` (wrapping the
    strategy's, or with a plain mock): the strategy's work around backward hangs on
    ``pre_backward``/``post_backward``, so such a patch neither recurses nor goes unseen."""
    strategy = tiered("host", tmp_path)
    with mock.patch.object(Strategy, "backward", wraps=strategy.backward) as spy:
        losses, _, _ = fit(strategy, tmp_path, Net, steps=2)
    assert len(losses) == 2 and spy.call_count == 2


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_double_precision(tmp_path, placement):
    assert_like_plain(tmp_path, placement, Net, precision="64-true")


# -- modules the strategy cannot place --------------------------------------------------------------


class Lazy(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks[0] = nn.LazyLinear(32)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_a_lazy_module_not_yet_materialized_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(ValueError, match=r"not materialized yet \(blocks.0.weight, blocks.0.bias.*Run one forward"):
        fit(tiered("host", tmp_path), tmp_path, Lazy)


class CompiledBlock(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks[2] = torch.compile(self.blocks[2])


def test_a_compiled_block_is_refused_when_its_parameters_are_offloaded(tmp_path):
    with pytest.raises(ValueError, match=r"torch.compile was applied to blocks.2, whose parameters are offloaded"):
        fit(tiered("host", tmp_path), tmp_path, CompiledBlock)


class SparseEmbedding(TwoOptimizers):
    """An embedding with sparse gradients and SparseAdam for it, the rest with Adam, both stepped
    after one backward (manual optimization)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32, sparse=True)

    def configure_optimizers(self):
        rest = [p for name, p in self.named_parameters() if not name.startswith("embed.")]
        return [torch.optim.SparseAdam(self.embed.parameters(), lr=1e-2), torch.optim.Adam(rest, lr=1e-2)]


def test_an_offloaded_embedding_with_sparse_gradients_is_refused_at_set_up(tmp_path):
    """Its gradients would be kept dense at home, and SparseAdam refused them at the first step."""
    with pytest.raises(ValueError, match=r"'embed' is an embedding with sparse=True whose weight is offloaded.*Set sparse=False"):
        fit(tiered("host", tmp_path), tmp_path, SparseEmbedding)
    losses, _, _ = fit("auto", tmp_path / "plain", SparseEmbedding)  # the recipe itself trains
    assert len(losses) == 3  # max_steps=6 counts both optimizers' steps


# -- failures are raised, never swallowed ----------------------------------------------------------


class CorruptNvmeAtTrainEnd(L.Callback):
    """The NVMe files are damaged after the last step, before the strategy reads them back."""

    def on_train_end(self, trainer, pl_module):
        store = trainer.strategy.engine.store
        for path in Path(store.path).glob("*.bin"):
            with open(path, "r+b") as f:
                f.write(b"\xff" * 64)


def test_a_read_failure_at_the_end_of_fit_is_raised(tmp_path):
    strategy = tiered("nvme", tmp_path, checksums=True)
    with pytest.raises(OSError, match="came back different from what was written"):
        fit(strategy, tmp_path, Net, steps=2, callbacks=(CorruptNvmeAtTrainEnd(),))


class CorruptSwapBeforeBackward(L.Callback):
    def on_before_backward(self, trainer, pl_module, loss):
        store = trainer.strategy.tiered.activations.swap_store
        damaged = 0
        for path in Path(store.path).glob("*.bin"):
            if path.stat().st_size:
                with open(path, "r+b") as f:
                    f.write(b"\xff" * 64)
                damaged += 1
        assert damaged


def test_checksums_cover_activations_swapped_to_nvme(tmp_path):
    strategy = tiered("nvme", tmp_path, checksums=True, activations="swap_nvme")
    with pytest.raises(OSError, match="came back different from what was written"):
        fit(strategy, tmp_path, Net, steps=2, callbacks=(CorruptSwapBeforeBackward(),))


# -- reading and writing parameters between steps ---------------------------------------------------


class Ema(L.Callback):
    """An exponential moving average of the weights, read after every step; copied into the model
    at the end of training (a write from outside the step)."""

    def __init__(self) -> None:
        self.average: dict[str, torch.Tensor] = {}

    def _gathered(self, trainer, writeback: bool = False):
        gather = getattr(trainer.strategy, "gathered_parameters", None)
        return gather(writeback=writeback) if gather is not None else contextlib.nullcontext()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with self._gathered(trainer), torch.no_grad():
            for name, p in pl_module.named_parameters():
                value = p.detach().clone()
                self.average[name] = value if name not in self.average else 0.9 * self.average[name] + 0.1 * value

    def on_train_end(self, trainer, pl_module):
        with self._gathered(trainer, writeback=True), torch.no_grad():
            for name, p in pl_module.named_parameters():
                p.copy_(self.average[name])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_an_ema_callback_reads_and_writes_true_values_through_gathered_parameters(tmp_path, placement):
    plain, model = assert_like_plain(tmp_path, placement, Net, callbacks=lambda: (Ema(),))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_weights_written_between_steps_reach_the_fp32_masters(tmp_path, placement):
    """Under bf16-true the optimizer updates fp32 masters kept apart from the 16-bit parameters: a
    write through gathered_parameters is where the next update starts, not lost at it."""

    class Halve(L.Callback):
        norms: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            with trainer.strategy.gathered_parameters(writeback=batch_idx == 2), torch.no_grad():
                self.norms.append(sum(float(p.float().norm()) for p in pl_module.parameters()))
                if batch_idx == 2:
                    for p in pl_module.parameters():
                        p.mul_(0.5)

    halve = Halve()
    fit(tiered(placement, tmp_path), tmp_path, Net, callbacks=(halve,), precision="bf16-true")
    before, after = halve.norms[2], halve.norms[3]
    assert 0.45 * before < after < 0.6 * before


# -- writing parameters inside the step ---------------------------------------------------------------


class MaxNormEmbedding(Net):
    """``nn.Embedding(max_norm=...)`` renormalises the rows it looks up, in place, in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32, max_norm=1.0)


class ConstrainedInStep(Net):
    """A weight constraint applied to the parameters themselves under ``torch.no_grad()`` at the
    start of every training step (parameters iterated: none is fetched for it)."""

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            for p in self.blocks.parameters():
                p.clamp_(-0.05, 0.05)
        return self.loss(batch)


@pytest.mark.parametrize("make", [MaxNormEmbedding, ConstrainedInStep], ids=["max_norm_embedding", "constraint_in_step"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_parameters_written_in_place_inside_the_step(tmp_path, placement, make):
    """A unit's GPU-tier copy written in place goes home before its eviction or update; one written
    at home after its copy was fetched is fetched again (lost, or overwritten, before)."""
    assert_like_plain(tmp_path, placement, make)


class WeightClippingWgan(L.LightningModule):
    """A WGAN critic's weights clipped through ``p.data`` (as the WGAN paper's code does), at the
    start of the training step or right after the critic's update, under manual optimization."""

    clip_at = "start"

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 32))
        self.critic = nn.Sequential(nn.Linear(32, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
        self.register_buffer("real", torch.randn(256, 32))

    def clip(self) -> None:
        for p in self.critic.parameters():
            p.data.clamp_(-0.05, 0.05)

    def training_step(self, batch, batch_idx):
        opt_g, opt_c = self.optimizers()
        real = self.real[batch[:, 0]]
        z = torch.randn(real.shape[0], 16, generator=torch.Generator().manual_seed(batch_idx)).to(real.device)
        if self.clip_at == "start":
            self.clip()
        critic_loss = -self.critic(real).mean() + self.critic(self.gen(z).detach()).mean()
        self.manual_backward(critic_loss)
        opt_c.step()
        opt_c.zero_grad()
        if self.clip_at == "after_update":
            self.clip()
        gen_loss = -self.critic(self.gen(z)).mean()
        self.manual_backward(gen_loss)
        opt_g.step()
        opt_g.zero_grad()
        opt_c.zero_grad()
        self.last_loss = critic_loss.detach() + gen_loss.detach()

    def configure_optimizers(self):
        return torch.optim.RMSprop(self.gen.parameters(), lr=5e-3), torch.optim.RMSprop(self.critic.parameters(), lr=5e-3)


class ClipAfterUpdate(WeightClippingWgan):
    clip_at = "after_update"


@pytest.mark.parametrize("make", [WeightClippingWgan, ClipAfterUpdate], ids=["clip_at_start", "clip_after_update"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_wgan_weight_clipping_through_data(tmp_path, placement, make):
    """Writes through ``p.data`` leave no version counter behind: at the start of the step they land
    at home before anything is fetched (a copy fetched earlier missed them); an NVMe unit handing
    out its ``.data`` inside the step writes its copy home; one lent after the critic's update is
    taken back before the generator's forward uses it (each trained to other values before)."""
    assert_like_plain(tmp_path, placement, make)


class CriticForwardsSeen(WeightClippingWgan):
    """Records, at each forward of the critic's first layer, whether its weight is its unit's
    GPU-tier copy."""

    def on_train_start(self) -> None:
        self.in_gpu_tier: list[bool] = []
        engine = self.trainer.strategy.engine

        def seen(module, args, output):
            s, position = engine.ctx.param_slot[id(module.weight)]
            copy = s.unit.views(s.device_slot.tensor)[position] if s.device_slot is not None else None
            self.in_gpu_tier.append(copy is not None and module.weight.data_ptr() == copy.data_ptr())

        self.critic[0].register_forward_hook(seen)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_forwards_after_an_optimizer_step_inside_the_training_step_compute_in_the_gpu_tier(tmp_path, placement):
    """Manual optimization: the generator's loss runs the critic after the critic's step. That
    forward ran as if between steps (units lent at home): on a GPU, with host tensors."""
    _, _, model = fit(tiered(placement, tmp_path), tmp_path / "run", CriticForwardsSeen, steps=4)  # two batches: two steps each
    assert len(model.in_gpu_tier) == 6 and all(model.in_gpu_tier)


class ForwardInCallback(L.Callback):
    """Runs the model on the batch after every step (as a callback logging predictions does), and
    records whether the first block computed with its GPU-tier copy, and whether every unit was
    back home once the forward returned."""

    def __init__(self) -> None:
        self.in_gpu_tier: list[bool] = []
        self.home_after: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:
            with torch.no_grad():
                pl_module(batch)
            return

        def seen(module, args, output):
            s, position = engine.ctx.param_slot[id(module.weight)]
            copy = s.unit.views(s.device_slot.tensor)[position] if s.device_slot is not None else None
            self.in_gpu_tier.append(copy is not None and module.weight.data_ptr() == copy.data_ptr())

        handle = pl_module.blocks[0].register_forward_hook(seen)
        with torch.no_grad():
            pl_module(batch)
        handle.remove()
        self.home_after.append(all(s.device_slot is None for s in engine.states if s.home != "gpu"))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_forward_a_callback_runs_between_steps_computes_in_the_gpu_tier(tmp_path, placement):
    """Such a forward found its parameters at their homes (lent): on a GPU, host tensors beside
    inputs on the GPU. It now fetches like an evaluation step, and leaves every unit home after."""
    seen = ForwardInCallback()
    assert_like_plain(tmp_path, placement, Net, callbacks=lambda: (seen,))
    assert len(seen.in_gpu_tier) == 6 and all(seen.in_gpu_tier) and all(seen.home_after)


class ResetInForward(Net):
    """A gate the forward sets to 1 in place before using it; the optimizer does not move it
    (learning rate 0), so only the write decides its value."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.full((32,), 2.0))

    def forward(self, batch):
        with torch.no_grad():
            self.gate.fill_(1.0)
        return self.head(self.norm(self.embed(batch[:, :-1]) * self.gate))

    def configure_optimizers(self):
        rest = [p for n, p in self.named_parameters() if n != "gate"]
        return torch.optim.SGD([{"params": rest}, {"params": [self.gate], "lr": 0.0}], lr=0.1)


@pytest.mark.parametrize("placement", list(PLACEMENTS_16_BIT))
def test_a_write_inside_the_step_reaches_the_fp32_master(tmp_path, placement):
    """Under bf16-true the update starts from the fp32 master: a value written to the 16-bit
    parameter in forward is what the master holds from then on, as plain training keeps it."""
    _, weights, _ = fit(PLACEMENTS_16_BIT[placement](tmp_path), tmp_path / "run", ResetInForward, steps=3, precision="bf16-true")
    assert torch.equal(weights["gate"], torch.ones(32, dtype=torch.bfloat16))


class WriteAttributes(L.Callback):
    """Writes weights read as module attributes after every step, as a weight-decay or
    re-initialisation callback does, once in place and once through ``.data``."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            pl_module.head.weight.mul_(0.5)
            pl_module.blocks[0].weight.data.add_(0.01)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_parameters_written_as_attributes_between_steps_are_kept(tmp_path, placement):
    """An attribute read between steps hands out the parameter at its home, so what is written
    there is what the next step computes with and updates (it used to reach a GPU-tier copy only)."""
    assert_like_plain(tmp_path, placement, Net, callbacks=lambda: (WriteAttributes(),))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("how", ["in place", "a new tensor"])
def test_an_attribute_written_between_steps_reaches_its_fp32_master(tmp_path, placement, how):
    class Halve(L.Callback):
        def __init__(self) -> None:
            self.norms: list[float] = []  # each run's own

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            with torch.no_grad():
                self.norms.append(float(pl_module.head.weight.float().norm()))
                if batch_idx == 2 and how == "in place":
                    pl_module.head.weight.mul_(0.5)
                elif batch_idx == 2:
                    pl_module.head.weight.data = pl_module.head.weight.data * 0.5

    halve = Halve()
    fit(tiered(placement, tmp_path), tmp_path, Net, callbacks=(halve,), precision="bf16-true")
    before, after = halve.norms[2], halve.norms[3]
    assert 0.45 * before < after < 0.6 * before


class GivesNewTensors(L.Callback):
    """Gives parameters tensors of their own between steps (``p.data = t``): an attribute and a
    max-norm constraint after the second step, every parameter after the fourth, as
    re-initialisation and constraint code does."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            if batch_idx == 1:
                pl_module.head.bias.data = torch.full_like(pl_module.head.bias, 0.1)
                pl_module.embed.weight.data = torch.renorm(pl_module.embed.weight.data, 2, 0, 0.5)
            if batch_idx == 3:
                for p in pl_module.parameters():
                    p.data = p.data * 0.9


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_parameters_given_new_tensors_between_steps_train_with_them(tmp_path, placement):
    """The engine used to bind the parameter back to its home at the next fetch, dropping the new
    tensor: training went on from the old values."""
    assert_like_plain(tmp_path, placement, Net, callbacks=lambda: (GivesNewTensors(),))


@pytest.mark.filterwarnings("ignore:parameter .* was given a tensor")
@pytest.mark.parametrize(("placement", "lottery"), [("host", False), ("nvme", "once")])
def test_model_pruning(tmp_path, placement, lottery):
    """Lightning's ``ModelPruning`` re-registers each weight as ``weight_orig`` with a mask, resets
    it to its initial values (``.data =``, the lottery ticket) and makes the pruning permanent at
    the end (``.data =`` again): both replacements used to be lost."""
    from lightning.pytorch.callbacks import ModelPruning

    def pruning() -> tuple:
        every_epoch = {"use_lottery_ticket_hypothesis": False, "apply_pruning": True}
        once = {"use_lottery_ticket_hypothesis": True, "apply_pruning": lambda epoch: epoch == 0}
        return (ModelPruning("l1_unstructured", amount=0.3, parameter_names=["weight"], verbose=0, **(once if lottery else every_epoch)),)

    plain, model = assert_like_plain(tmp_path, placement, Net, callbacks=pruning, steps=-1, max_epochs=3, limit_train_batches=2)
    assert float((model.blocks[0].weight == 0).float().mean()) >= 0.3


def test_a_new_tensor_that_shares_memory_is_taken_with_a_warning(tmp_path):
    """Plain training would keep the parameter and the tensor sharing memory; the values are
    taken, and the warning says the sharing is not kept."""

    class Shares(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                self.kept = pl_module.head.weight.detach().clone() * 2
                pl_module.head.weight.data = self.kept

    with pytest.warns(UserWarning, match=r"'head.weight' was given a tensor .* whose memory another live tensor shares"):
        fit(tiered("host", tmp_path), tmp_path, Net, callbacks=(Shares(),))


def test_a_new_tensor_of_another_shape_is_refused(tmp_path):
    class Grows(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pl_module.head.bias.data = torch.zeros(300)

    with pytest.raises(ValueError, match=r"'head.bias' was given a tensor of shape \(300,\).*where it has shape \(256,\).*p.copy_"):
        fit(tiered("host", tmp_path), tmp_path, Net, callbacks=(Grows(),))


class NewTensorInStep(Net):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            self.blocks[1].weight.data = self.blocks[1].weight.data * 0.5
        return self.loss(batch)


def test_a_new_tensor_inside_a_training_step_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(RuntimeError, match=r"'blocks.1.weight' was given a new tensor .* inside a training step.*p.copy_"):
        fit(tiered("host", tmp_path), tmp_path, NewTensorInStep)


class ChangesGradientsAfterBackward(Net):
    """``on_after_backward`` scales every gradient in place, replaces the head's and drops the
    norm's, as gradient surgery does."""

    def on_after_backward(self) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)
        self.head.weight.grad = self.head.weight.grad.clamp(-0.01, 0.01)
        self.norm.bias.grad = None


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_gradients_changed_in_on_after_backward(tmp_path, placement, accumulate):
    """Offloaded gradients used to be away from ``p.grad`` there (and, with nothing else waiting,
    already applied): the hook saw None and changed nothing."""
    assert_like_plain(tmp_path, placement, ChangesGradientsAfterBackward, accumulate_grad_batches=accumulate)


class ReplacesGradientsBeforeStep(Net):
    def on_before_optimizer_step(self, optimizer) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad = p.grad.clamp(-0.01, 0.01)
        self.norm.bias.grad = None


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_gradients_replaced_in_on_before_optimizer_step(tmp_path, placement):
    """A tensor put in ``p.grad`` before the step is the gradient stepped (and clipped), ``None``
    skips the parameter; the engine used to step the gradient at home regardless."""
    assert_like_plain(tmp_path, placement, ReplacesGradientsBeforeStep, gradient_clip_val=0.05)


# 16-bit parameters whose gradients the engine accumulates in fp32 for their masters (bf16-true)

class FirstGradients(L.Callback):
    def __init__(self) -> None:
        self.seen: dict[str, Optional[torch.Tensor]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.seen:
            self.seen = {n: None if p.grad is None else p.grad.clone() for n, p in pl_module.named_parameters()}


@pytest.mark.parametrize("make", [Net, MatricesOnly], ids=["every_parameter_stepped", "some_stepped_by_no_optimizer"])
@pytest.mark.parametrize("placement", list(PLACEMENTS_16_BIT))
def test_hooks_see_every_16_bit_gradient_as_plain_training_has_it(tmp_path, placement, make):
    """Under bf16-true the engine keeps a 16-bit parameter's gradient in fp32 for its master; hooks
    reading ``p.grad`` (gradient-norm logging, clipping of one's own) used to find None for every
    parameter, resident or not, and then for those no optimizer steps. They now see it in the
    parameter's dtype: at the first step the same tensors as plain training's."""
    plain, tiered_run = FirstGradients(), FirstGradients()
    fit("auto", tmp_path / "plain", make, steps=1, callbacks=(plain,), precision="bf16-true")
    fit(PLACEMENTS_16_BIT[placement](tmp_path), tmp_path / "tiered", make, steps=1, callbacks=(tiered_run,), precision="bf16-true")
    assert all(g is not None and g.dtype == torch.bfloat16 for g in tiered_run.seen.values())
    assert_same_weights(plain.seen, tiered_run.seen)


class HalvesGradients(Net):
    """SGD at twice the rate over gradients halved in ``on_after_backward``; with ``drops``, the
    norm's bias loses its gradient before the step."""

    lr, drops = 0.2, False

    def on_after_backward(self) -> None:
        for p in self.parameters():
            p.grad.mul_(0.5)

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.drops:
            self.norm.bias.grad = None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class SameStepUnhooked(Net):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class HalvesAndDrops(HalvesGradients):
    drops = True


@pytest.mark.parametrize("placement", list(PLACEMENTS_16_BIT))
def test_16_bit_gradients_changed_by_hooks_reach_the_fp32_masters(tmp_path, placement):
    """Halving every bf16 gradient in place is exact, so SGD at twice the rate after it steps the
    fp32 masters exactly as SGD unhooked does; a gradient set to None is not stepped (one step:
    every other parameter as unhooked)."""
    def run(make: Callable[[], L.LightningModule], name: str, steps: int) -> dict[str, torch.Tensor]:
        return fit(PLACEMENTS_16_BIT[placement](tmp_path / name), tmp_path / f"{name}-run", make, steps=steps, precision="bf16-true")[1]

    assert_same_weights(run(SameStepUnhooked, "unhooked", 3), run(HalvesGradients, "halved", 3))
    unhooked, dropped = run(SameStepUnhooked, "unhooked-1", 1), run(HalvesAndDrops, "dropped", 1)
    L.seed_everything(7, verbose=False)
    initial = Net().to(torch.bfloat16)
    assert torch.equal(dropped["norm.bias"], initial.norm.bias) and not torch.equal(unhooked["norm.bias"], initial.norm.bias)
    assert_same_weights({k: v for k, v in unhooked.items() if k != "norm.bias"}, {k: v for k, v in dropped.items() if k != "norm.bias"})


class ReadsBetweenSteps(L.Callback):
    def __init__(self, how: str) -> None:
        self.how, self.values = how, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import copy

        if self.how == "attribute":
            self.values.append(float(pl_module.head.weight.norm()))
        elif self.how == "iterate":
            self.values.append(float(torch.stack([p.norm() for p in pl_module.parameters()]).sum()))
        else:
            self.values.append(float(copy.deepcopy(pl_module).head.weight.sum()))


@pytest.mark.parametrize("how", ["attribute", "iterate", "deepcopy"])
def test_a_parameter_read_between_steps_holds_its_true_value(tmp_path, how):
    """Parameters of units at home on NVMe, read between steps as attributes, by iterating
    ``parameters()`` or through a copy of the module, hold what plain training holds (they used
    to show placeholders to all but attribute reads)."""
    reads = [ReadsBetweenSteps(how), ReadsBetweenSteps(how)]
    fit("auto", tmp_path / "plain", Net, callbacks=(reads[0],))
    fit(tiered("nvme", tmp_path), tmp_path / "tiered", Net, callbacks=(reads[1],))
    assert reads[0].values == reads[1].values and len(reads[1].values) == 6


class PenaltyOverParameters(Net):
    """An L2 penalty over ``self.parameters()`` in the training step: parameters read outside
    their modules' forwards, in the middle of the step."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.loss(batch) + 1e-3 * sum(p.pow(2).sum() for p in self.parameters())


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_penalty_over_every_parameter_in_the_training_step(tmp_path, placement):
    assert_like_plain(tmp_path, placement, PenaltyOverParameters)


class ReadsBeforeUpdate(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.values.append(float(sum(p.double().sum() for p in pl_module.parameters())))


def test_parameters_read_before_the_update_on_nvme(tmp_path):
    reads = [ReadsBeforeUpdate(), ReadsBeforeUpdate()]
    fit("auto", tmp_path / "plain", Net, callbacks=(reads[0],))
    fit(tiered("nvme", tmp_path), tmp_path / "tiered", Net, callbacks=(reads[1],))
    assert reads[0].values == reads[1].values and len(reads[1].values) == 6


def test_a_parameter_read_after_the_engine_closed_with_a_failure_is_an_error_not_a_value(tmp_path):
    """Lending needs the engine: a placeholder read with no engine to lend raises, naming the
    parameter, where it used to compute with NaN."""
    from offload_strategy import OffloadedParameterError
    from offload_strategy.runtime.params.offloaded import mark_offloaded, offloaded_class

    p = nn.Parameter(torch.full((1,), float("nan")).expand(3, 4))
    mark_offloaded(p, offloaded_class(lambda _, hands_out: False), "block.weight")
    assert p.shape == (3, 4) and p.requires_grad  # metadata stays readable
    p.requires_grad_(False)
    with pytest.raises(OffloadedParameterError, match=r"on parameter 'block.weight'"):
        float(p.sum())
    with pytest.raises(OffloadedParameterError, match=r"block.weight"):
        p.data.clone()
    assert "at home on NVMe" in repr(p)


class OptimizerStates(L.Callback):
    """Reads Adam's first moments through the user's optimizer after every step (through the
    optimizer and through Lightning's wrapper), and resets them after the third, as a callback
    that restarts the moments does."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        optimizer, wrapper = trainer.optimizers[0], pl_module.optimizers()
        self.norms.append(float(sum(optimizer.state[p]["exp_avg"].double().norm() for p in pl_module.parameters() if p in optimizer.state)))
        assert len(wrapper.state) == len(optimizer.state) == sum(1 for p in pl_module.parameters() if p.requires_grad)
        if batch_idx == 2:
            for state in optimizer.state.values():
                state["exp_avg"].zero_()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_optimizer_states_read_and_written_between_steps(tmp_path, placement):
    """The user's optimizer's ``state`` holds the real states during training (it used to be
    empty under offloading), on NVMe too, and what a callback writes there is what the next
    update starts from."""
    callbacks = [OptimizerStates(), OptimizerStates()]
    plain_losses, plain_weights, _ = fit("auto", tmp_path / "plain", Net, callbacks=(callbacks[0],))
    losses, weights, _ = fit(tiered(placement, tmp_path), tmp_path / "tiered", Net, callbacks=(callbacks[1],))
    assert callbacks[0].norms == callbacks[1].norms and callbacks[1].norms[0] > 0
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


class Validated(Net):
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_weight_averaging_that_swaps_weights_around_validation(tmp_path, placement):
    """Lightning's ``WeightAveraging`` copies the average into the parameters when validation
    starts and the training weights back when it ends (``.data.copy_`` on every parameter): after
    an evaluation step the parameters used to point at GPU-tier copies, so the weights copied back
    never reached home and training went on from the average."""
    from lightning.pytorch.callbacks import WeightAveraging

    assert_like_plain(tmp_path, placement, Validated, callbacks=lambda: (WeightAveraging(),), steps=14, limit_val_batches=1)


def test_stochastic_weight_averaging_with_units_in_host_memory(tmp_path):
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    assert_like_plain(tmp_path, "host", Net, callbacks=lambda: (StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1),), steps=9)


def test_stochastic_weight_averaging_with_units_on_nvme_is_refused_with_what_to_do(tmp_path):
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    with pytest.raises(ValueError, match=r"StochasticWeightAveraging reads and writes every parameter.*gathered_parameters"):
        fit(tiered("nvme", tmp_path), tmp_path, Net, callbacks=(StochasticWeightAveraging(swa_lrs=1e-3),))


# -- models with shared modules ---------------------------------------------------------------------


class T5(L.LightningModule):
    """An encoder-decoder whose one ``shared`` embedding serves the encoder, the decoder and the tied head."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(
            vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=True,
        )
        self.model = T5ForConditionalGeneration(config)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[:, :8].contiguous(), labels=batch[:, 8:].contiguous()).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("activations", ["keep", "swap_nvme"])
def test_a_shared_embedding_trains_at_the_smallest_gpu_tier_set_up_accepts(tmp_path, activations):
    """Modules that read the shared embedding's weight as an attribute (the tied head, T5's
    scaling) must not hold GPU-tier buffers a module needs: the minimum the fixed layout's count
    names (after set-up's for the parameters alone) is enough."""
    import re

    from offload_strategy.planning.placement import PlacementError

    def strategy(gpu_memory: int) -> TieredStrategy:
        nvme = {"nvme_path": str(tmp_path / "nvme"), "nvme_memory": "1GiB"} if activations == "swap_nvme" else {}
        return TieredStrategy(policy={"placement": "fill", "activations": activations}, gpu_memory=gpu_memory, host_memory="1GiB", **nvme)

    def minimum(error: BaseException) -> int:
        number, unit = re.search(r"to at least ([\d.]+) (KiB|MiB)", str(error)).groups()
        return int(float(number) * {"KiB": 1024, "MiB": 1024**2}[unit])

    with pytest.raises(PlacementError, match=r"raise gpu_memory to at least") as refused:
        fit(strategy(1024), tmp_path / "small", T5, steps=1)
    # the layout is fixed: the first forward measures it, and it is counted in the GPU tier beside the parameters' least share
    with pytest.raises(ValueError, match=r"the activation layout policy.activations fixes .* Raise gpu_memory to at least") as fixed:
        fit(strategy(int(minimum(refused.value) * 1.05)), tmp_path / "parameters", T5, steps=1)
    plain_losses, plain_weights, _ = fit("auto", tmp_path / "plain", T5, steps=4)
    losses, weights, _ = fit(strategy(minimum(fixed.value)), tmp_path / "tiered", T5, steps=4)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_the_default_policy_names_the_minimum_for_parameters_and_then_for_activations(tmp_path):
    """Under the default policy the blocks' activations share the GPU tier and are measured in the
    first step: set-up's minimum says it counts parameters alone, the first block's forward names
    the least for both, the forward's end the minimum with what it keeps outside the blocks (the
    decoder's, the logits'), before anything is updated, and at that minimum the model trains as
    plain Lightning does."""
    import re

    from offload_strategy.planning.placement import PlacementError

    def minimum(error: BaseException, pattern: str) -> int:
        number, unit = re.search(pattern + r" ([\d.]+) (KiB|MiB)", str(error)).groups()
        return int(float(number) * {"KiB": 1024, "MiB": 1024**2}[unit])

    def strategy(gpu_memory: int) -> TieredStrategy:
        return TieredStrategy(gpu_memory=gpu_memory, host_memory="1GiB")

    with pytest.raises(PlacementError, match=r"for parameters alone: with policy.activations='auto'") as refused:
        fit(strategy(1024), tmp_path / "small", T5, steps=1)
    batches = Losses()
    with pytest.raises(ValueError, match=r"no layout of keep / checkpoint / swap fits .* in the first block.s forward") as first:
        fit(strategy(int(minimum(refused.value, "to at least") * 1.05)), tmp_path / "parameters", T5, steps=3, callbacks=(batches,))
    assert batches.values == [], "the run trained a step before it stopped"
    # what the forward keeps after the first block's stack was not known there: the forward's end counts it
    with pytest.raises(ValueError, match=r"no layout of keep / checkpoint / swap fits .* before any update. .* of activations outside the blocks") as stopped:
        fit(strategy(int(minimum(first.value, "must be at least") * 1.05)), tmp_path / "blocks", T5, steps=3, callbacks=(batches,))
    assert batches.values == [], "the run trained a step before it stopped"
    plain_losses, plain_weights, _ = fit("auto", tmp_path / "plain", T5, steps=4)
    losses, weights, _ = fit(strategy(int(minimum(stopped.value, "must be at least") * 1.05)), tmp_path / "tiered", T5, steps=4)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


@pytest.mark.parametrize("make", [Net, T5], ids=["net", "t5-shared-embedding"])
def test_without_prefetch_the_gpu_tier_needs_no_buffer_for_the_next_unit(tmp_path, make):
    """``prefetch=False`` fetches each unit when a module asks for it: the smallest GPU tier is a
    module's own units, one buffer of the largest unit less than with prefetch, and the model
    trains beside its kept layout there as plain Lightning does (a tied weight read as an attribute included)."""
    import re

    from offload_strategy.planning.placement import PlacementError

    def refused_minimum(prefetch: bool) -> int:
        with pytest.raises(PlacementError) as refused:
            fit(TieredStrategy(policy={"placement": "fill", "activations": "keep", "prefetch": prefetch}, gpu_memory=1024, host_memory="1GiB"),
                tmp_path / f"small{prefetch}", make, steps=1)
        number, unit = re.search(r"to at least ([\d.]+) (KiB|MiB)", str(refused.value)).groups()
        assert ("prefetch off" in str(refused.value)) is not prefetch
        return int(float(number) * {"KiB": 1024, "MiB": 1024**2}[unit])

    without, with_prefetch = refused_minimum(False), refused_minimum(True)
    assert without < with_prefetch

    def unprefetched(gpu_memory: int) -> TieredStrategy:
        return TieredStrategy(policy={"placement": "fill", "activations": "keep", "prefetch": False}, gpu_memory=gpu_memory, host_memory="1GiB")

    # the kept layout is counted in the GPU tier once the first forward measured it: the least it names beside the parameters
    with pytest.raises(ValueError, match=r"the activation layout policy.activations fixes .* Raise gpu_memory to at least") as fixed:
        fit(unprefetched(without), tmp_path / "parameters", make, steps=1)
    number, unit = re.search(r"to at least ([\d.]+) (KiB|MiB)", str(fixed.value)).groups()
    plain_losses, plain_weights, _ = fit("auto", tmp_path / "plain", make, steps=4)
    losses, weights, _ = fit(unprefetched(int(float(number) * {"KiB": 1024, "MiB": 1024**2}[unit])), tmp_path / "tiered", make, steps=4)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


# -- the training step's own code and gradients ----------------------------------------------------

COPIED_HOME = {"gradient_reserve": 1.0}  # offloaded gradients produced in the GPU tier and copied home, as on a GPU


class Manual(Net):
    """The recipe model under manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class ClipsItsOwnGradients(Manual):
    """Manual optimization as GAN and RL code writes it: the gradients' norm logged after
    ``manual_backward``, then clipped by norm with Lightning's ``clip_gradients`` and by value
    with torch's ``clip_grad_value_`` over ``self.parameters()``, then the step."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.last_loss = self.loss(batch)
        self.manual_backward(self.last_loss)
        self.norms.append(float(torch.stack([p.grad.norm() for p in self.parameters()]).norm()))
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        torch.nn.utils.clip_grad_value_(self.parameters(), 0.001)
        opt.step()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_manual_optimization_reads_and_clips_the_gradients_after_manual_backward(tmp_path, placement):
    """Where gradients are copied home (every offloaded unit on a GPU), the training step's own
    code found ``p.grad`` None after ``manual_backward``: reading it failed, and clipping clipped
    nothing (``clip_grad_value_`` failed). They are now on ``.grad`` until the step, as after
    plain backward."""
    plain, model = assert_like_plain(tmp_path, placement, ClipsItsOwnGradients, policy=COPIED_HOME)
    assert model.norms == plain.norms


class GradientsByHand(Manual):
    """Manual optimization with gradients that no backward accumulates: ``torch.autograd.grad``'s
    results put on ``.grad`` by hand (as per-sample-gradient and estimator code does), then the step."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.last_loss = self.loss(batch)
        params = list(self.parameters())
        for p, g in zip(params, torch.autograd.grad(self.last_loss, params)):
            p.grad = g * 0.5
        opt.step()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_gradients_put_on_grad_by_hand_are_stepped(tmp_path, placement):
    """The offloaded units' updates read their gradients at home, where no backward had put
    them: the step used none, silently."""
    assert_like_plain(tmp_path, placement, GradientsByHand, policy=COPIED_HOME)


class Maml(Net):
    """MAML's inner step: fast weights from ``torch.autograd.grad`` (second order), the outer loss
    computed with them through ``torch.func.functional_call``."""

    def training_step(self, batch, batch_idx):
        params = dict(self.named_parameters())
        target = batch[:, 1:].flatten()
        inner = nn.functional.cross_entropy(torch.func.functional_call(self, params, (batch,)).flatten(0, 1), target)
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {name: p - 0.1 * g for (name, p), g in zip(params.items(), grads)}
        return nn.functional.cross_entropy(torch.func.functional_call(self, fast, (batch,)).flatten(0, 1), target)


def test_checkpointed_blocks_recompute_with_the_weights_functional_call_gave_them(tmp_path):
    """A checkpointed block recomputed its forward in backward with the module's own parameters,
    where the forward had run with ``functional_call``'s fast weights: other gradients, silently
    (and the default policy checkpoints blocks in its first steps)."""
    assert_like_plain(tmp_path, "host", Maml, policy={"activations": "checkpoint"}, steps=3)


class PerSampleWithTorchFunc(Manual):
    """Per-sample gradients as torch.func's tutorial takes them, inside the training step."""

    def training_step(self, batch, batch_idx):
        params = {name: p.detach() for name, p in self.named_parameters()}

        def loss(params: dict, x: torch.Tensor) -> torch.Tensor:
            out = torch.func.functional_call(self, params, (x[None],))
            return nn.functional.cross_entropy(out.flatten(0, 1), x[None, 1:].flatten())

        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, batch)


def test_torch_func_grad_inside_the_training_step_says_what_to_use_instead(tmp_path):
    with pytest.raises(RuntimeError, match=r"torch.func.grad .* inside a training step.*use torch.autograd.grad"):
        fit(tiered("host", tmp_path), tmp_path, PerSampleWithTorchFunc, steps=1)


# -- gradients taken outside the training step -----------------------------------------------------


def streamed(placement: str, root: Path) -> TieredStrategy:
    """A GPU tier that leaves the seven units 110 KiB, three buffers, beside the kept layout's
    234 KiB of activations (placed again there after the first step): every forward evicts units
    it used."""
    nvme = {"nvme_path": str(root / "nvme"), "nvme_memory": "1GiB"} if placement == "nvme" else {}
    policy = {"placement": placement, "activations": "keep", **COPIED_HOME}
    return TieredStrategy(policy=policy, gpu_memory="344KiB", host_memory="1GiB", **nvme)


class AdversarialValidation(Net):
    """Validation under a three-step sign-gradient attack on the embeddings (``torch.enable_grad``
    inside ``validation_step``), and ``torch.func.grad`` of the loss over the weights there."""

    def validation_step(self, batch, batch_idx):
        target = batch[:, 1:].flatten()
        with torch.enable_grad():
            x = self.embed(batch[:, :-1]).detach()
            delta = torch.zeros_like(x, requires_grad=True)
            for _ in range(3):
                h = x + delta
                for block in self.blocks:
                    h = h + torch.tanh(block(h))
                loss = nn.functional.cross_entropy(self.head(self.norm(h)).flatten(0, 1), target)
                (g,) = torch.autograd.grad(loss, delta)
                delta = (delta + 0.01 * g.sign()).detach().requires_grad_()
        weights = {name: p.detach().clone() for name, p in self.named_parameters()}
        grads = torch.func.grad(lambda w: nn.functional.cross_entropy(torch.func.functional_call(self, w, (batch,)).flatten(0, 1), target))(weights)
        self.seen.append((float(loss), float(torch.stack([g.norm() for g in grads.values()]).norm())))

    def on_fit_start(self) -> None:
        self.seen: list[tuple[float, ...]] = []


class InputGradients(L.Callback):
    """After every step, gradients of the model's outputs over its inputs, as saliency and
    attribution callbacks take them: ``torch.autograd.grad`` once the forward has returned, and
    ``torch.func``'s ``grad``, ``vmap`` and ``jacrev`` over modules with their own weights."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, ...]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        x = torch.ones(2, 32, requires_grad=True, device=pl_module.device)
        (saliency,) = torch.autograd.grad(pl_module.head(pl_module.norm(x)).pow(2).sum(), x)
        grad = torch.func.grad(lambda h: pl_module.head(pl_module.norm(h)).pow(2).sum())(torch.ones(2, 32, device=pl_module.device))
        vmapped = torch.func.vmap(lambda b: pl_module(b[None]).sum())(batch)
        jacobian = torch.func.jacrev(lambda h: pl_module.blocks[1](h))(torch.ones(32, device=pl_module.device))
        self.seen.append(tuple(float(t.detach().norm()) for t in (saliency, grad, vmapped, jacobian)))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_gradients_taken_outside_the_training_step_are_plain_trainings(tmp_path, placement):
    """Before: a backward after units were evicted read their parameters at their homes, at NVMe
    placeholders (NaN) or, in validation, wherever eviction had left them (other losses, silently);
    a ``torch.func`` transform rebinding parameters inside it crashed the process."""
    callbacks = lambda: (InputGradients(),)  # noqa: E731
    kwargs = dict(steps=4, limit_val_batches=1, val_check_interval=2)
    plain_losses, plain_weights, plain = fit("auto", tmp_path / "plain", AdversarialValidation, callbacks=callbacks(), **kwargs)
    losses, weights, model = fit(streamed(placement, tmp_path), tmp_path / "tiered", AdversarialValidation, callbacks=callbacks(), **kwargs)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert model.seen == plain.seen and len(model.seen) == 2
    seen = [c for c in model.trainer.callbacks if isinstance(c, InputGradients)][0].seen
    assert seen == [c for c in plain.trainer.callbacks if isinstance(c, InputGradients)][0].seen and len(seen) == 4


class DetachedForFunctionalCall(Net):
    def training_step(self, batch, batch_idx):
        weights = {name: p.detach().requires_grad_() for name, p in self.named_parameters()}
        return self.loss(batch) + torch.func.functional_call(self, weights, (batch,)).sum() * 0.0


def test_functional_call_given_views_of_streamed_copies_is_refused(tmp_path):
    """``p.detach()`` of a parameter at its unit's GPU-tier copy is a view of a buffer other units
    reuse as the forward goes on: the forward computed with their weights, silently."""
    with pytest.raises(RuntimeError, match=r"was given a view of a GPU-tier buffer.*p\.detach\(\)\.clone\(\)"):
        fit(streamed("nvme", tmp_path), tmp_path, DetachedForFunctionalCall, steps=1)


class ClipsWithLightning(Manual):
    """Lightning's ``clip_gradients`` called by the training step between backward and the step."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.last_loss = self.loss(batch)
        self.manual_backward(self.last_loss)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_clip_gradients_under_manual_optimization_clips_as_the_automatic_step_does(tmp_path, placement):
    """Under ``bf16-true`` Lightning's ``clip_gradients`` called by the training step clips the
    fp32 gradients the engine holds, as ``gradient_clip_val`` does under automatic optimization
    (it used to clip 16-bit copies, and on a GPU would find no gradient at all for offloaded units)."""
    manual_losses, manual, _ = fit(tiered(placement, tmp_path, **COPIED_HOME), tmp_path / "manual", ClipsWithLightning, steps=4, precision="bf16-true")
    losses, weights, _ = fit(tiered(placement, tmp_path, **COPIED_HOME), tmp_path / "auto", Net, steps=4, precision="bf16-true", gradient_clip_val=0.05)
    assert manual_losses == losses
    assert_same_weights(weights, manual)


class SwitchToSgd(L.Callback):
    """Gives the trainer another optimizer after the second step, as a schedule moving from Adam to
    SGD does (``trainer.optimizers = [...]``)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2 and isinstance(trainer.optimizers[0], torch.optim.AdamW):
            trainer.optimizers = [torch.optim.SGD(pl_module.parameters(), lr=0.05, momentum=0.9)]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_optimizers_replaced_by_a_callback_step_the_model_from_then_on(tmp_path, placement):
    """The first backward after the switch updated the offloaded units with the old optimizer
    (the only one the engine knew then), silently; on NVMe the new states did not fit the files
    and buffers laid out for the old ones' and the step stopped. The model is now placed again
    with the new optimizers."""
    assert_like_plain(tmp_path, placement, Net, callbacks=lambda: (SwitchToSgd(),))


class OptimizerInBackward(Manual):
    """The optimizer step fused into backward, as PyTorch's tutorial and GaLore's layer-wise
    updates do it: an AdamW per parameter stepped by a post-accumulate-grad hook, no optimizer
    for Lightning."""

    def configure_optimizers(self):
        return None

    def on_fit_start(self) -> None:
        optimizers = {p: torch.optim.AdamW([p], lr=1e-2) for p in self.parameters()}

        def step(p: torch.Tensor) -> None:
            optimizers[p].step()
            optimizers[p].zero_grad()

        for p in self.parameters():
            p.register_post_accumulate_grad_hook(step)

    def training_step(self, batch, batch_idx):
        self.last_loss = self.loss(batch)
        self.manual_backward(self.last_loss)


class GradientStatistics(Net):
    """Automatic optimization with a post-accumulate-grad hook recording each gradient's norm."""

    def on_fit_start(self) -> None:
        self.norms: list[float] = []
        for p in self.parameters():
            p.register_post_accumulate_grad_hook(lambda p: self.norms.append(float(p.grad.norm())))


@pytest.mark.parametrize("make", [OptimizerInBackward, GradientStatistics])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_users_post_accumulate_grad_hooks_see_the_gradients(tmp_path, placement, make):
    """The engine's hook, registered first, moved each gradient home and left ``p.grad`` None
    before the user's hooks ran: their steps stepped nothing, their statistics failed."""
    plain, model = assert_like_plain(tmp_path, placement, make, policy=COPIED_HOME, max_epochs=1, limit_train_batches=6)
    assert getattr(model, "norms", None) == getattr(plain, "norms", None)


class ResetsAdam(Net):
    """Resets the optimizer's states before the fourth step, as warm restarts and pruning
    schedules do: ``state.clear()``, a new ``state`` mapping, or one parameter's entry replaced
    and another's deleted."""

    how = "clear"

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx != 3:
            return
        optimizer = self.trainer.optimizers[0]
        if self.how == "clear":
            optimizer.state.clear()
        elif self.how == "new mapping":
            optimizer.state = collections.defaultdict(dict)
        else:
            optimizer.state[self.blocks[1].weight] = {}
            del optimizer.state[self.head.weight]


@pytest.mark.parametrize("how", ["clear", "new mapping", "some entries"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_optimizer_states_reset_by_user_code(tmp_path, placement, how):
    """A new mapping was ignored (the units kept their states); on NVMe a cleared state stopped
    the next update (the unit's file layout still named the removed states)."""
    make = type("Resets", (ResetsAdam,), {"how": how})
    assert_like_plain(tmp_path, placement, make)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_optimizer_states_are_live_after_resuming(tmp_path, placement):
    """Loading the optimizer's state dict (a resume) left its ``state`` an empty mapping: a
    callback found no moments there, and what it wrote reached no update."""

    def trainer(strategy: Any, root: Path, steps: int, callbacks: list) -> L.Trainer:
        return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=root, callbacks=callbacks)

    def resumed(strategy: Any, resume: Any, root: Path) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
        L.seed_everything(7, verbose=False)
        trainer(strategy, root, 3, [ModelCheckpoint(dirpath=root / "ckpt", save_last=True)]).fit(Net(), datamodule=tiny_data())
        L.seed_everything(7, verbose=False)
        model, losses, states = Net(), Losses(), OptimizerStates()
        trainer(resume, root, 7, [losses, states]).fit(model, datamodule=tiny_data(), ckpt_path=str(root / "ckpt" / "last.ckpt"))
        return losses.values, {k: v.detach().clone() for k, v in model.state_dict().items()}, states.norms

    plain = resumed("auto", "auto", tmp_path / "plain")
    ours = resumed(tiered(placement, tmp_path / "a"), tiered(placement, tmp_path / "b"), tmp_path / "tiered")
    assert ours[0] == plain[0] and ours[2] == plain[2] and len(ours[2]) == 4
    assert_same_weights(plain[1], ours[1])
