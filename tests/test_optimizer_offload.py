"""The user's optimizer applied per unit behind a facade: same numbers as plain training for the
common optimizers and schedulers, and state dicts that move between tiered and plain training."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from offload_strategy import TieredStrategy
from tests.helpers import PARAMETERS_ONLY, assert_same_weights, tiny_data, train

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
    "adam-amsgrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
    "sgd-nesterov": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
}


class Net(L.LightningModule):
    """Embedding, blocks and head, two param groups, a per-step LR schedule."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 256)
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x = self.embed(batch[:, :-1])
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = OPTIMIZERS[self.optimizer]([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Offloaded(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        engine = trainer.strategy.engine
        if engine is None and trainer.global_step == 1:
            return  # SGD's parameters, gradients and states fit the whole tier: offloading starts once the kept layout is counted after the first step
        assert engine is not None and any(s.home == "host" for s in engine.states)


def param_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in Net().parameters())


# the kept layout's peak in the GPU tier at tiny_data's batch, measured in the first training step
# (30 KiB in the blocks, 84 KiB outside them, 120 KiB of the backward's gradients); under 16-mixed
# and for Manual's half batches, measured alike
KEPT_PEAK, KEPT_PEAK_16_MIXED, KEPT_PEAK_HALF_BATCH = 239_524, 248_228, 119_764


def offloading(peak: int = KEPT_PEAK, **kwargs) -> TieredStrategy:
    """0.85 of the parameters' bytes for them once they are placed again beside the kept layout's
    ``peak`` after the first step: some units stay on host memory."""
    return TieredStrategy(gpu_memory=int(0.85 * param_bytes()) + peak, host_memory="1GiB", **{"policy": PARAMETERS_ONLY, **kwargs})


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_and_schedulers_match_plain_training(tmp_path, name):
    make = lambda: Net(name)  # noqa: E731
    plain_losses, plain_weights, plain = train("auto", tmp_path / "plain", epochs=2, make_model=make)
    losses, weights, tiered = train(offloading(), tmp_path / "tiered", epochs=2, make_model=make, extra_callbacks=(Offloaded(),))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert tiered.optimizers[0].param_groups[0]["lr"] == plain.optimizers[0].param_groups[0]["lr"] < 1e-2


def test_state_dicts_move_between_tiered_and_plain(tmp_path):
    """A checkpoint of either strategy resumes in the other with the same numbers."""
    full_losses, full_weights, _ = train("auto", tmp_path / "full", epochs=2, make_model=Net)
    for first, second in (("tiered", "auto"), ("auto", "tiered")):
        make = lambda kind: offloading() if kind == "tiered" else "auto"  # noqa: E731
        root = tmp_path / f"{first}-then-{second}"
        train(make(first), root / "a", epochs=2, stop_after_epochs=1, save_every_epoch=True, make_model=Net)
        checkpoint = root / "a" / "ckpt" / "epoch=0.ckpt"
        state = torch.load(checkpoint, weights_only=True)["optimizer_states"][0]
        assert len(state["state"]) == len(list(Net().parameters())) and len(state["param_groups"]) == 2
        losses, weights, _ = train(make(second), root / "b", epochs=2, resume=checkpoint, make_model=Net)
        assert losses == full_losses[len(full_losses) - len(losses) :], (first, second)
        assert_same_weights(full_weights, weights)


def test_optimizer_state_dict_is_standard_during_and_after_training(tmp_path):
    captured = {}

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            captured["during"] = trainer.optimizers[0].state_dict()

    _, _, plain = train("auto", tmp_path / "plain", epochs=1, make_model=Net)
    _, _, tiered = train(offloading(), tmp_path / "tiered", epochs=1, make_model=Net, extra_callbacks=(Capture(),))
    expected = plain.optimizers[0].state_dict()
    for got in (captured["during"], tiered.optimizers[0].state_dict()):
        assert got["param_groups"] == expected["param_groups"]
        assert got["state"].keys() == expected["state"].keys()
        for index, values in expected["state"].items():
            for key, value in values.items():
                assert torch.equal(got["state"][index][key], value), (index, key)


def test_whole_model_optimizers_are_refused(tmp_path):
    class WithLbfgs(Net):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match="LBFGS.step requires a closure: it re-evaluates the whole model inside its step"):
        trainer = L.Trainer(strategy=offloading(), accelerator="cpu", devices=1, max_steps=1, logger=False, default_root_dir=tmp_path)
        trainer.fit(WithLbfgs(), datamodule=tiny_data())


def test_updates_run_while_backward_continues(tmp_path):
    """LoHan's active gradient offloading: a unit's update starts on the worker before backward
    has finished with the other units, and every unit is still updated exactly once."""
    seen = []

    class Timeline(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            engine = trainer.strategy.engine
            seen.append((list(engine.updater.log), list(engine.saved_tensors.backward_log), len(engine.updater.optimizers[id(trainer.optimizers[0])].slots)))

    train(offloading(), tmp_path, epochs=1, make_model=Net, extra_callbacks=(Timeline(),))
    overlapped = 0
    for updates, backward, units in seen[1:]:
        assert sorted(u for u, _, _ in updates) == sorted(set(u for u, _, _ in updates)) and len(updates) == units
        overlapped += sum(1 for _, start, _ in updates if start < backward[-1])
    assert overlapped > 0, "no update started before backward ended"


def test_accumulation_defers_updates_to_the_last_micro_batch(tmp_path):
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=Net, accumulate_grad_batches=3)
    losses, weights, _ = train(offloading(), tmp_path / "tiered", epochs=2, make_model=Net, accumulate_grad_batches=3)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_matches_plain_training(tmp_path, algorithm):
    clip = dict(gradient_clip_val=0.02, gradient_clip_algorithm=algorithm)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=Net, **clip)
    unclipped, _, _ = train("auto", tmp_path / "unclipped", epochs=2, make_model=Net)
    assert unclipped != plain_losses, "the clip value is too large to change anything"
    losses, weights, _ = train(offloading(), tmp_path / "tiered", epochs=2, make_model=Net, extra_callbacks=(Offloaded(),), **clip)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_fp16_loss_scaling_matches_plain_training(tmp_path):
    """Lightning allows 16-mixed only on GPUs by name; the same plugin instance runs on CPU. The
    initial scale overflows fp16, so the first steps are skipped, in both runs alike."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    scalers = {}

    def plugin(name):
        scalers[name] = torch.amp.GradScaler("cpu", init_scale=2.0**28)
        return MixedPrecision("16-mixed", "cpu", scaler=scalers[name])

    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=Net, precision=None, plugins=[plugin("plain")])
    losses, weights, _ = train(offloading(KEPT_PEAK_16_MIXED), tmp_path / "tiered", epochs=2, make_model=Net, precision=None, plugins=[plugin("tiered")],
                               extra_callbacks=(Offloaded(),))
    assert scalers["plain"].get_scale() < 2.0**28, "no step overflowed: the test shows nothing about skipping"
    assert scalers["tiered"].get_scale() == scalers["plain"].get_scale()
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


@pytest.mark.parametrize("reserve", [0.0, 0.5, 1.0])
def test_gradients_written_straight_home_or_copied(tmp_path, reserve):
    """GO-MemFerry's reserve factor: 0 writes every offloaded unit's gradient straight into host
    memory (no device-to-host copies), 1 produces them all in the GPU tier and copies them home."""
    seen = {}

    class Links(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            metrics = trainer.strategy.metrics()
            seen["direct"] = metrics["units/direct_gradients"]
            seen["offloaded"] = metrics["units/host"] + metrics["units/nvme"]
            seen["d2h"] = metrics["link/d2h_bytes_total"]

    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=Net, accumulate_grad_batches=2)
    strategy = offloading(policy={**PARAMETERS_ONLY, "gradient_reserve": reserve})
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=Net, accumulate_grad_batches=2, extra_callbacks=(Links(),))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    if reserve == 0.0:
        assert seen["direct"] == seen["offloaded"] > 0 and seen["d2h"] == 0
    elif reserve == 1.0:
        assert seen["direct"] == 0 and seen["d2h"] > 0
    else:
        assert 0 < seen["direct"] < seen["offloaded"] and seen["d2h"] > 0


class Manual(Net):
    """Manual optimization: two backward passes per step, the user steps and zeroes."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        half = batch.shape[0] // 2
        for part in (batch[:half], batch[half:]):
            loss = super().training_step(part, batch_idx)
            self.manual_backward(loss)
        optimizer.step()
        self.lr_schedulers().step()
        return loss


def test_manual_optimization_matches_plain_training(tmp_path):
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=Manual)
    losses, weights, _ = train(offloading(KEPT_PEAK_HALF_BATCH), tmp_path / "tiered", epochs=2, make_model=Manual, extra_callbacks=(Offloaded(),))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_optimizer_state_dict_holds_no_second_copy_of_host_states(tmp_path):
    """Like torch's own state_dict, the facade's gives the state tensors themselves (a checkpoint
    of a model whose states fill host memory must not need that memory twice)."""
    shared = {}

    class Check(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            engine = trainer.strategy.engine
            unit_optimizers = engine.updater.optimizers[id(trainer.optimizers[0])]
            state = trainer.optimizers[0].state_dict()["state"]
            live = {t.data_ptr() for slot in unit_optimizers.slots.values() for m in slot.masters for t in slot.inner.state[m].values() if torch.is_tensor(t) and t.dim()}
            saved = [t for values in state.values() for t in values.values() if torch.is_tensor(t) and t.dim()]
            shared["all"] = bool(saved) and all(t.data_ptr() in live for t in saved)

    train(offloading(), tmp_path, epochs=1, make_model=Net, extra_callbacks=(Check(),))
    assert shared["all"]
