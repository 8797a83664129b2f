"""The precision plugin of the Trainer's strategies (``lightning/precision.py``): Lightning's hooks
run in plain training's order and see plain training's gradients, whatever the recipe, and the
glue reaches Lightning only through its plugin points (no method put on an instance, no private
call)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from tests.test_recipes import Net, TwoOptimizers, fit, tiered

PACKAGE = Path(__file__).resolve().parents[1] / "offload_strategy"

# Methods of Lightning's precision plugins and of optimizers, which the glue must not replace on an instance.
PLUGIN_AND_OPTIMIZER_METHODS = {
    "clip_gradients", "clip_grad_by_norm", "clip_grad_by_value", "pre_backward", "backward", "post_backward", "optimizer_step",
    "_after_closure", "_wrap_closure", "_clip_gradients", "step", "zero_grad", "state_dict", "load_state_dict",
}
# The engine's per-unit optimizers still answer the user's optimizer's own calls from its instance:
# torch has no hook on zero_grad, and its state_dict hooks run after the default body has read every
# state (NVMe units' included).
FACADE = ("runtime/updates/optimizers.py", {"zero_grad", "state_dict", "load_state_dict"})


def _imports_lightning(tree: ast.AST) -> bool:
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    return any(name.split(".")[0] == "lightning" for name in names)


def _patches(path: Path) -> list[str]:
    """Where ``path`` puts a plugin's or optimizer's method on another object, swaps an object's
    class in the Lightning glue (the runtime's offloaded parameters change class by design), or
    calls Lightning's private ``call``."""
    found = []
    relative = path.relative_to(PACKAGE).as_posix()
    tree = ast.parse(path.read_text())
    glue = _imports_lightning(tree)
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            if not isinstance(target, ast.Attribute) or (isinstance(target.value, ast.Name) and target.value.id == "self"):
                continue
            allowed = relative == FACADE[0] and target.attr in FACADE[1]
            if (target.attr == "__class__" and glue) or (target.attr in PLUGIN_AND_OPTIMIZER_METHODS and not allowed):
                found.append(f"{relative}:{node.lineno} assigns .{target.attr}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_call_") and isinstance(node.value, ast.Name) and node.value.id == "call":
            found.append(f"{relative}:{node.lineno} calls Lightning's private call.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "lightning.pytorch.trainer" and any(a.name == "call" for a in node.names):
            found.append(f"{relative}:{node.lineno} imports Lightning's private trainer.call")
    return found


def test_no_module_patches_lightning_or_calls_its_private_hooks():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in _patches(path)]
    assert not found, "the glue reaches Lightning through its plugin points only:\n" + "\n".join(found)


def test_the_scan_finds_each_kind_of_patch(tmp_path):
    """The scan above would see the patches it forbids."""
    sample = PACKAGE / "_scan_sample.py"
    sample.write_text(
        "from lightning.pytorch.trainer import call\n"
        "def f(plugin, optimizer, trainer):\n"
        "    plugin.clip_gradients = print\n"
        "    optimizer.__class__ = type\n"
        "    call._call_callback_hooks(trainer, 'on_before_optimizer_step', optimizer)\n"
    )
    try:
        found = _patches(sample)
    finally:
        sample.unlink()
    assert len(found) == 4, found


# -- the hooks, beside plain Lightning ------------------------------------------------------------------


def _gradient_sum(module: torch.nn.Module) -> float:
    return float(sum(p.grad.double().abs().sum() for p in module.parameters() if p.grad is not None))


class Recorder:
    """What the hooks saw, in order: each hook's name and the sum of the gradients it found."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def note(self, name: str, module: torch.nn.Module) -> None:
        self.calls.append((name, repr(_gradient_sum(module))))  # exact, and an overflowed step's nan equals nan


def recording(base: type) -> type:
    """``base`` with its hooks around backward and the step recorded."""

    class Recording(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.recorder = Recorder()

        def on_after_backward(self) -> None:
            self.recorder.note("on_after_backward", self)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.recorder.note("on_before_optimizer_step", self)

        def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None) -> None:
            self.recorder.note("configure_gradient_clipping", self)
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            self.recorder.note("clipped", self)

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            self.recorder.note("optimizer_zero_grad", self)
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    return Recording


class ManualClips(TwoOptimizers):
    """Manual optimization, two optimizers, the step's own clipping between backward and the steps."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        body, head = self.optimizers()
        body.zero_grad()
        head.zero_grad()
        self.last_loss = self.loss(batch)
        self.manual_backward(self.last_loss)
        self.recorder.note("after manual_backward", self)
        self.clip_gradients(body, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        self.clip_gradients(head, gradient_clip_val=0.01, gradient_clip_algorithm="value")
        self.recorder.note("after clip_gradients", self)
        body.step()
        head.step()


def _scaled() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**28))


RECIPES = {
    "clip by norm": (Net, dict(gradient_clip_val=0.05)),
    "clip by value": (Net, dict(gradient_clip_val=0.01, gradient_clip_algorithm="value")),
    "accumulation, clip by norm": (Net, dict(gradient_clip_val=0.05, accumulate_grad_batches=2)),
    "bf16-mixed, clip by norm": (Net, dict(gradient_clip_val=0.05, precision="bf16-mixed")),
    "manual, two optimizers": (ManualClips, {}),
}


def _fit_recorded(strategy: Any, root: Path, base: type, **kwargs: Any) -> tuple[list[float], dict[str, torch.Tensor], list[tuple[str, str]]]:
    losses, weights, model = fit(strategy, root, recording(base), **kwargs)
    return losses, weights, model.recorder.calls


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_hooks_see_plain_trainings_gradients_in_its_order(tmp_path, recipe):
    base, kwargs = RECIPES[recipe]
    plain = _fit_recorded("auto", tmp_path / "plain", base, **kwargs)
    tiered_run = _fit_recorded(tiered("host", tmp_path), tmp_path / "tiered", base, **kwargs)
    assert len(plain[2]) >= 6 and any(float(total) > 0 for _, total in plain[2]), "the hooks saw no gradient: the test shows nothing"
    assert tiered_run[2] == plain[2]
    assert tiered_run[0] == plain[0]
    for name in plain[1]:
        assert torch.equal(plain[1][name], tiered_run[1][name]), name


def test_loss_scaling_steps_skips_and_checkpoints_as_plain_training(tmp_path):
    """16-mixed with a scaler: unscaled gradients in the hooks, the same skipped steps, and the
    scaler's state in the checkpoint under the plain plugin's name, which loads it back."""
    runs = {}
    for name, strategy in (("plain", "auto"), ("tiered", tiered("host", tmp_path))):
        losses, weights, model = fit(strategy, tmp_path / name, recording(Net), gradient_clip_val=0.05, plugins=[_scaled()])
        model.trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
        runs[name] = (losses, weights, model.recorder.calls, model.trainer.precision_plugin.scaler.get_scale())
    assert runs["tiered"][2] == runs["plain"][2] and runs["tiered"][0] == runs["plain"][0]
    assert runs["plain"][3] < 2.0**28, "no step overflowed: the test shows nothing about skipped steps"
    assert runs["tiered"][3] == runs["plain"][3]
    plain, tiered_checkpoint = (torch.load(tmp_path / f"{name}.ckpt", weights_only=False) for name in ("plain", "tiered"))
    assert "TieredPrecision" not in tiered_checkpoint and tiered_checkpoint["MixedPrecision"] == plain["MixedPrecision"]
    resumed = tiered("host", tmp_path).precision_plugin
    resumed.plugin = _scaled()
    resumed.on_load_checkpoint(tiered_checkpoint)  # as Lightning's connector restores it
    assert resumed.scaler is not None and resumed.scaler.get_scale() == runs["plain"][3]
