"""A layout the user fixes (``activations="keep"``, a policy per block) is counted in the GPU tier
as a planned layout is: measured in the first training forward, refused before any update where
it does not fit beside the least share of the tier the parameters can take, and otherwise the
parameters are placed in what it leaves."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from offload_strategy import TieredStrategy
from tests.helpers import assert_same_weights
from tests.test_activation_budget import GPU_TIER, Stack, fit

KiB = 1024


class Backwards(L.Callback):
    """Counts the backward passes that ended (the first update follows the first)."""

    def __init__(self) -> None:
        self.count = 0

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.count += 1


class Parameters(L.Callback):
    """The parameters' share of the GPU tier and the fixed layout's measured peak, after each step."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        activations = trainer.strategy.tiered.activations
        assert activations.fixed is not None, "the first training forward measured the layout"
        self.steps.append((activations.gpu_parameter_bytes(), activations.fixed.peak_bytes))


def test_a_kept_layout_that_does_not_fit_the_gpu_tier_is_refused_before_any_update(tmp_path: Path) -> None:
    """Eight blocks kept at batch 100 hold 1,280 bytes a sample each, 1 MiB: more than a 512 KiB
    GPU tier leaves beside even the fewest streaming buffers. Before, the run trained with them
    counted nowhere (on a GPU: beyond the budget, or out of memory); now the first forward's
    measurement stops it before backward, with what the layout holds, what the tier leaves it and
    what to do."""
    backwards = Backwards()
    strategy = TieredStrategy(policy={"placement": "host", "activations": "keep"}, gpu_memory=GPU_TIER, host_memory="256MiB")
    with pytest.raises(ValueError, match=r"the activation layout policy.activations fixes \(8 keep, 8 blocks\) holds") as refused:
        fit(strategy, tmp_path, batch=100, steps=2, callbacks=(backwards,))
    message = str(refused.value)
    assert backwards.count == 0, "a backward ran before the refusal"
    held = float(re.search(r"holds ([\d.]+) MiB of activations", message).group(1))
    assert held >= 8 * 1280 * 100 / 2**20, message  # every block's activations, and what is beside them
    left, least = (float(x) for x in re.search(r"leaves it ([\d.]+) KiB beside the least the parameters can be placed in, ([\d.]+) KiB", message).groups())
    assert left + least == pytest.approx(GPU_TIER / KiB, abs=0.01) and left < held * 1024, message
    assert "gpu_memory to at least" in message and "policy.activations='auto'" in message and "'checkpoint'" in message


def test_the_gpu_memory_the_refusal_names_trains_like_plain(tmp_path: Path) -> None:
    """The least gpu_memory the refusal names holds the same kept layout, bit for bit as plain, and
    holds it in the step that measures it too: that step runs the parameters in one buffer more
    than their least share, which the minimum named counted nowhere before (the first step passed
    the tier it named by a unit's buffer)."""
    keep = {"placement": "host", "activations": "keep"}
    with pytest.raises(ValueError) as refused:
        fit(TieredStrategy(policy=keep, gpu_memory=GPU_TIER, host_memory="256MiB"), tmp_path / "refused", batch=100, steps=2)
    number, unit = re.search(r"gpu_memory to at least ([\d.]+) (KiB|MiB)", str(refused.value)).groups()
    named = int(float(number) * {"KiB": KiB, "MiB": KiB * KiB}[unit]) + KiB  # (the message rounds)
    plain = fit("auto", tmp_path / "plain", batch=100, steps=3)
    share = Parameters()
    tiered = fit(TieredStrategy(policy=keep, gpu_memory=named, host_memory="256MiB"), tmp_path / "tiered", batch=100, steps=3,
                 callbacks=(share,))
    assert all(parameters + peak <= named for parameters, peak in share.steps), (named, share.steps)
    assert tiered.losses == plain.losses
    assert_same_weights(plain.state_dict(), tiered.state_dict())


def test_parameters_filling_the_tier_are_placed_again_beside_a_kept_layout(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``policy="fill"`` fills the GPU tier with resident units and buffers: the kept blocks' 80 KiB
    at batch 8 fit beside the parameters' least share, not beside the tier filled. The first step,
    which measures the layout, runs the parameters in that least share (it ran them in the whole
    tier, the layout beyond it); after it they are placed again in what the layout's measured peak
    leaves, and training is the same bit for bit as plain Lightning's."""
    plain = fit("auto", tmp_path / "plain", batch=8, steps=4)
    share = Parameters()
    tiered = fit(TieredStrategy(policy="fill", gpu_memory=GPU_TIER, host_memory="256MiB"), tmp_path / "tiered", batch=8, steps=4,
                 callbacks=(share,))
    assert tiered.losses == plain.losses
    assert_same_weights(plain.state_dict(), tiered.state_dict())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tiered: the activation layout policy.activations fixes")]
    assert len(said) == 1 and "placed again in" in said[0], said
    (first, peak), *later = share.steps
    assert first + peak <= GPU_TIER, "the first step ran beside the tier filled"
    assert later and all(first < parameters and parameters + peak <= GPU_TIER for parameters, _ in later), share.steps


def accumulated(strategy: Any, root: Path) -> tuple[list[float], dict]:
    """Stack at batch 8, two micro-batches a step, three steps."""
    L.seed_everything(3, verbose=False)
    model = Stack()
    model.losses = []
    data = DataLoader(TensorDataset(torch.randn(48, 64), torch.randn(48, 1)), batch_size=8)
    L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    ).fit(model, data)
    return model.losses, model.state_dict()


def test_under_accumulation_the_parameters_are_placed_again_only_after_the_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The first micro-batch measures the kept layout; its gradients wait at home for the second,
    so the parameters are placed again after the optimizer step, not between the two."""
    plain_losses, plain_weights = accumulated("auto", tmp_path / "plain")
    losses, weights = accumulated(TieredStrategy(policy="fill", gpu_memory=GPU_TIER, host_memory="256MiB"), tmp_path / "tiered")
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tiered:")]
    placed_again = [i for i, m in enumerate(said) if m.startswith("tiered: the activation layout policy.activations fixes")]
    assert len(placed_again) == 1, said


def test_a_mixed_fixed_layout_is_measured_as_it_runs_and_trains_like_plain(tmp_path: Path) -> None:
    """Recomputed, swapped and kept blocks measured under their own policies (each block's
    forward counted on its way to the checkpoint's or the swap's hooks): nothing they compute
    changes, and what the kept layout would hold is more than this one holds."""
    mixed = ["checkpoint", "swap_host", "keep", "checkpoint", "swap_host", "keep", "checkpoint", "keep"]
    plain = fit("auto", tmp_path / "plain", batch=8, steps=3)
    peaks = {}
    for name, layout in (("mixed", mixed), ("kept", "keep")):
        share = Parameters()
        tiered = fit(TieredStrategy(policy={"placement": "host", "activations": layout}, gpu_memory=4 * GPU_TIER, host_memory="256MiB"),
                     tmp_path / name, batch=8, steps=3, callbacks=(share,))
        assert tiered.losses == plain.losses
        assert_same_weights(plain.state_dict(), tiered.state_dict())
        peaks[name] = share.steps[-1][1]
    assert 0 < peaks["mixed"] < peaks["kept"], peaks


def test_a_tier_that_holds_the_layout_beside_the_least_share_alone_says_the_first_step_passes_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Between the parameters' least share beside the layout (accepted) and the minimum the refusal
    names (that and the one buffer more the measuring step runs them in), the first step passes
    gpu_memory by less than a unit's buffer: said once with the numbers and the tier that holds it,
    and the steps after it hold the tier."""
    keep = {"placement": "host", "activations": "keep"}
    with pytest.raises(ValueError) as refused:
        fit(TieredStrategy(policy=keep, gpu_memory=GPU_TIER, host_memory="256MiB"), tmp_path / "refused", batch=100, steps=2)
    message = str(refused.value)
    least = float(re.search(r"beside the least the parameters can be placed in, ([\d.]+) KiB", message).group(1))
    peak = float(re.search(r"holds ([\d.]+) MiB of activations", message).group(1))
    between = int((least * KiB + peak * KiB * KiB)) + 4 * KiB  # (the message rounds)
    share = Parameters()
    fit(TieredStrategy(policy=keep, gpu_memory=between, host_memory="256MiB"), tmp_path / "between", batch=100, steps=3, callbacks=(share,))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tiered: the first training step, which measured")]
    assert len(said) == 1 and "holds the first step too" in said[0], said
    (first, held), *later = share.steps
    assert first + held > between, share.steps
    assert later and all(parameters + held <= between for parameters, _ in later), share.steps
