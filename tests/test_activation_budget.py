"""The default policy's first steps with a GPU tier that activations fill: refused as early as the
blocks' memory is known, with numbers that work, and the searched plan placed as it was priced."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from offload_strategy import TieredStrategy
from tests.helpers import assert_same_weights

# beside 195 KiB of streaming buffers, the first steps' layout (the first block kept, the others
# recomputed: two blocks' activations at the last one's backward) and the backward's gradients
# (twice the ReLU's output) fit up to batch 52 (6,144 bytes a sample in 324,608)
GPU_TIER = 512 * 1024


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return x + self.down(torch.relu(self.up(x)))


class Stack(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(8))
        self.head = nn.Linear(64, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        for block in self.blocks:
            x = block(x)
        loss = self.loss(self.head(x), y)
        self.losses.append(loss.item())
        return loss

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(
    strategy: Any, root: Path, batch: int, steps: int = 4, sizes: Optional[list[int]] = None, callbacks: tuple = (), make: type = Stack,
) -> Stack:
    """``sizes``: one batch size per step instead (``batch`` and ``steps`` then unused)."""
    L.seed_everything(3, verbose=False)
    model = make()
    model.losses = []
    sizes = sizes or [batch] * steps
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    samples = TensorDataset(torch.randn(sum(sizes), 64), torch.randn(sum(sizes), 1))
    data = DataLoader(samples, batch_sampler=[list(range(a, a + n)) for a, n in zip(starts, sizes)])
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=len(sizes), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, callbacks=list(callbacks),
    )
    trainer.fit(model, data)
    return model


def watched() -> tuple[type[Stack], list[Stack]]:
    """A Stack class that keeps its instances (the run's model: its blocks count their forwards)."""
    seen: list[Stack] = []

    class Watched(Stack):
        def __init__(self) -> None:
            super().__init__()
            seen.append(self)

    return Watched, seen


def assert_trains_like_plain(tmp_path: Path, gpu_memory: int, batch: int) -> None:
    plain = fit("auto", tmp_path / "plain", batch)
    tiered = fit(TieredStrategy(gpu_memory=gpu_memory, host_memory="256MiB"), tmp_path / "tiered", batch)
    assert tiered.losses == plain.losses
    assert_same_weights(plain.state_dict(), tiered.state_dict())


def test_the_searched_layout_is_placed_beside_parameters_placed_for_it(tmp_path):
    """At the largest batch that fits (52), beside streaming buffers for one module at a time. The
    parameters were placed again for the profiling layout (every block but the first recomputed,
    so a block's two units together): 195 KiB, where the search had left them 170 KiB, and the run
    stopped between its second and third steps."""
    assert_trains_like_plain(tmp_path, GPU_TIER, batch=52)


def refused_at(tmp_path: Path, batch: int) -> tuple[str, list[int]]:
    """The refusal's message at ``batch``, and how many forwards each block had run by then."""
    Watched, seen = watched()
    with pytest.raises(ValueError, match=r"no layout of keep / checkpoint / swap fits") as refused:
        L.seed_everything(3, verbose=False)
        Watched.losses = []
        data = DataLoader(TensorDataset(torch.randn(4 * batch, 64), torch.randn(4 * batch, 1)), batch_size=batch)
        L.Trainer(
            strategy=TieredStrategy(gpu_memory=GPU_TIER, host_memory="256MiB"), accelerator="cpu", devices=1, max_steps=2,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        ).fit(Watched(), data)
    return str(refused.value), [block.forwards for block in seen[0].blocks]


def named_share(message: str) -> float:
    return float(re.search(r"at most ([\d.]+)% of this step's", message).group(1))


def named_gpu_memory(message: str) -> int:
    number, unit = re.search(r"gpu_memory must be at least ([\d.]+) (KiB|MiB)", message).groups()
    return int(math.ceil(float(number) * {"KiB": 1024, "MiB": 1024**2}[unit]))


def test_activations_no_layout_fits_are_refused_after_the_first_block_with_a_batch_that_fits(tmp_path):
    """Every block saves what the first one did: once it has run forward, the first steps' own
    layout (the first block kept, the others recomputed) does not fit 512 KiB beside the
    parameters' 195 KiB at batch 100, with the backward's gradients (twice the block's largest
    tensor). The refusal comes there, before the second block's forward, and the share and the
    gpu_memory it names train. (A refusal at the end of the forward, once what the forward keeps
    after the blocks is known: ``test_the_layout_leaves_room_for_the_backward_s_gradients``.)"""
    # a block keeps 1,280 bytes a sample (its input among them), a recomputed block's input 256;
    # the backward's gradients are twice the ReLU's output, 2,048 bytes a sample. The first steps'
    # layout at the last block's backward: the first block's 1,280, six inputs (1,536) and the
    # last block's 1,280, 4,096 bytes a sample; with the gradients, 6,144
    message, forwards = refused_at(tmp_path / "first", batch=100)
    assert forwards[:2] == [1, 0], "the second block ran before the refusal"
    assert "measured in the first block's forward" in message and "is not known yet" in message
    assert "the smallest peak is 614,400 bytes" in message and "200.00 KiB for the backward's gradients" in message
    share = named_share(message)
    assert share == 52.8  # 512 KiB less 195 KiB of buffers (324,608 bytes) over 100 x 6,144 bytes
    assert_trains_like_plain(tmp_path / "batch", GPU_TIER, batch=math.floor(100 * share / 100))
    assert_trains_like_plain(tmp_path / "gpu", named_gpu_memory(message), batch=100)


# no search, so no profiling placement: a run whose parameters all fit starts without an engine
# (under the search its profiled steps stream them, tests/test_profiling_fits.py)
FILL = {"name": "auto", "placement": "fill"}


def test_the_first_engine_built_between_steps_steps_the_batch_it_was_built_in(tmp_path):
    """Parameters, gradients and Adam states (4.0 MiB) fit 6.5 MiB at set-up: no engine. At batch
    1,000 the activations measured by the first three steps do not fit beside them, so the fourth
    step's forward placed the units in host memory, inside Lightning's closure, after the strategy
    had handed the step to the plain optimizer: that step's update was lost (Adam's step count 3
    after 4 steps) and every weight diverged, silently. Planning now runs before the closure."""
    plain = fit("auto", tmp_path / "plain", batch=1000, steps=5)
    tiered = fit(TieredStrategy(gpu_memory="6656KiB", host_memory="256MiB", policy=FILL), tmp_path / "tiered", batch=1000, steps=5)
    assert tiered.losses == plain.losses
    assert_same_weights(plain.state_dict(), tiered.state_dict())


def test_a_run_told_everything_fits_hears_why_the_units_move_when_the_activations_do_not(tmp_path, caplog):
    """The same run: the first line said "nothing is offloaded" with no word about the
    activations, and the next showed every unit in host memory as if the first had been wrong. Now
    the first line says it holds unless the activations do not fit, and the move is announced with
    the share the parameters get."""
    fit(TieredStrategy(gpu_memory="6656KiB", host_memory="256MiB", policy=FILL), tmp_path, batch=1000, steps=4)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tiered:")]
    assert said[0].startswith("tiered: everything fits") and "unless the activations the first training step measures" in said[0]
    assert said[1].startswith("tiered: the activations measured in the first training steps do not fit"), said
    assert re.search(r"placed again in [\d.]+ (KiB|MiB) of it", said[1]) and "host" in said[2]


class HeldInTheGpuTier(L.Callback):
    """Each step's batch, the activations its forward kept in the GPU tier, and the parameters' share of it."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        tiered = trainer.strategy.tiered
        saved = int(trainer.strategy.metrics()["activations/saved_bytes"])
        self.steps.append((len(batch[0]), saved, tiered.activations.gpu_parameter_bytes()))


def test_a_batch_larger_than_the_profiled_ones_is_laid_out_again_before_its_blocks_save(tmp_path, caplog):
    """Dynamic padding, or a larger batch later: the first steps (batch 16) are profiled and the
    blocks laid out for them (two keep, beside 390 KiB of parameters), then batches of 24 and 64
    come. The layout planned for 16 kept 312 KiB of activations at 64, beside the parameters' 390
    in a 512 KiB tier (on a GPU, out of memory mid-run). Now the first block's input shows the
    growth before any block saves: 24 is laid out again beside the parameters as placed; no layout
    fits beside them at 64, so that one step runs the least-peak layout and the parameters are
    placed again before the next, after which every step fits."""
    sizes = [16] * 5 + [24, 64, 64, 16]
    plain = fit("auto", tmp_path / "plain", 0, sizes=sizes)
    held = HeldInTheGpuTier()
    tiered = fit(TieredStrategy(gpu_memory=GPU_TIER, host_memory="256MiB"), tmp_path / "tiered", 0, sizes=sizes, callbacks=(held,))
    assert tiered.losses == plain.losses
    assert_same_weights(plain.state_dict(), tiered.state_dict())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tiered: a batch whose blocks take")]
    assert [re.search(r"take ([\d.]+)x", m).group(1) for m in said] == ["1.50", "2.67"], said
    assert "no layout fits beside the parameters" not in said[0] and "placed again before the next" in said[1]
    assert [batch for batch, _, _ in held.steps] == sizes
    # from the first step under a planned layout (the profiling steps' own placement is not this test's)
    over = [k for k, (_, saved, parameters) in enumerate(held.steps) if k >= 3 and saved + parameters > GPU_TIER]
    assert over in ([], [6]), held.steps  # the first batch of 64 ran beside the parameters as placed for 24
    batch, saved, parameters = held.steps[7]
    assert saved + parameters <= GPU_TIER and parameters < held.steps[6][2], held.steps


def test_the_first_block_of_a_larger_batch_runs_under_the_layout_laid_out_for_it(tmp_path):
    """Everything fits 6 MiB at batch 16, all blocks kept; then batch 300, laid out again as S S S
    S K K K K beside the parameters. The first block's own call had resolved its forward before
    the layout changed, so it kept its activations in that step (0.99 of the tier, where the next
    step of the same batch held 0.93). Now it runs under its new policy: the growth step holds
    what the next one does."""
    sizes = [16] * 5 + [300, 300]
    plain = fit("auto", tmp_path / "plain", 0, sizes=sizes)
    held = HeldInTheGpuTier()
    budget = 6 * 1024 * 1024
    tiered = fit(TieredStrategy(gpu_memory=budget, host_memory="256MiB"), tmp_path / "tiered", 0, sizes=sizes, callbacks=(held,))
    assert tiered.losses == plain.losses
    assert_same_weights(plain.state_dict(), tiered.state_dict())
    (_, grown, parameters), (_, after, _) = held.steps[5], held.steps[6]
    assert grown == after, held.steps
    assert grown + parameters <= budget
    assert held.steps[5][1] < held.steps[4][1] * 300 / 16, "the larger batch kept every block"


def test_a_batch_no_layout_fits_stops_before_its_blocks_run_with_what_fits(tmp_path):
    """Batch 16 profiled, then 1,000: no layout fits even beside the parameters' smallest share.
    The run stops as that step's first block is called, before it runs, with the minimum, as the
    first step's refusal does."""
    Watched, seen = watched()
    with pytest.raises(ValueError, match=r"no layout .* scaled from the measured blocks to a batch whose blocks' inputs are 62.50x theirs") as refused:
        L.seed_everything(3, verbose=False)
        Watched.losses = []
        sizes = [16] * 5 + [1000]
        samples = TensorDataset(torch.randn(sum(sizes), 64), torch.randn(sum(sizes), 1))
        data = DataLoader(samples, batch_sampler=[list(range(16 * k, 16 * k + n)) for k, n in enumerate(sizes)])
        L.Trainer(
            strategy=TieredStrategy(gpu_memory=GPU_TIER, host_memory="256MiB"), accelerator="cpu", devices=1, max_steps=len(sizes),
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        ).fit(Watched(), data)
    assert seen[0].blocks[0].forwards == len(sizes) - 1, "a block ran the batch that fits no layout"
    assert re.search(r"gpu_memory must be at least [\d.]+ (KiB|MiB)", str(refused.value))


def test_the_profiled_steps_stream_the_parameters_so_their_activations_fit_beside(tmp_path):
    """The first-use placement filled 731 KiB of the 768 KiB tier with buffers and a resident
    unit, and the profiled steps' activations (the first block kept, the others' inputs: 279 KiB
    at batch 64) came on top: 1.3x the tier (on a GPU, out of memory in the first step). Until
    the activations are measured the parameters now stream through the fewest buffers, and every
    step, the profiled ones included, holds parameters and activations within the tier; the
    search then places them for what was measured (more of the tier than while profiling)."""
    budget = 768 * 1024
    plain = fit("auto", tmp_path / "plain", batch=64, steps=6)
    held = HeldInTheGpuTier()
    tiered = fit(TieredStrategy(gpu_memory=budget, host_memory="256MiB"), tmp_path / "tiered", batch=64, steps=6, callbacks=(held,))
    assert tiered.losses == plain.losses
    assert_same_weights(plain.state_dict(), tiered.state_dict())
    assert all(saved + parameters <= budget for _, saved, parameters in held.steps), held.steps
    assert held.steps[-1][2] > held.steps[0][2], held.steps  # placed for what the profiled steps measured


class GeluBlock(nn.Module):
    """Every tensor it saves is its own: its input, the first linear's output, the GELU's output."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class Classes(Stack):
    """Eight GELU blocks and a head over 1,024 classes: at batch 64 the log-softmax of its logits
    (256 KiB) outweighs two blocks' activations kept (2 x 144 KiB)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GeluBlock() for _ in range(8))
        self.head = nn.Linear(64, 1024)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, (y.abs() * 1000).long().clamp(max=1023).squeeze(1))


def test_the_layout_counts_the_activations_the_forward_keeps_outside_the_blocks(tmp_path):
    """The layout's peak counted the blocks alone: the log-softmax and the head's input (272.5 KiB
    outside the blocks) came on top, and after planning the steps held 1.08x a 1.5 MiB tier (on a
    GPU, out of memory). The profiled steps now measure what the forward keeps outside the blocks,
    and the layout and the parameters are planned beside it: every step within the tier."""
    budget = 1792 * 1024
    plain = fit("auto", tmp_path / "plain", batch=64, steps=6, make=Classes)
    held = HeldInTheGpuTier()
    strategy = TieredStrategy(gpu_memory=budget, host_memory="256MiB")
    tiered = fit(strategy, tmp_path / "tiered", batch=64, steps=6, callbacks=(held,), make=Classes)
    assert tiered.losses == plain.losses
    assert_same_weights(plain.state_dict(), tiered.state_dict())
    beside = strategy.tiered.activations.beside
    assert all(saved + parameters + beside.gradients <= budget for _, saved, parameters in held.steps), held.steps
    assert 64 * 1024 * 4 + 64 * 64 * 4 <= beside.outside <= held.steps[-1][1], beside  # the log-softmax and the head's input, at least
    # all of it saved after the blocks (the first block's input is the batch, saved in the block),
    # freed by the head's backward; a block's backward makes gradients of its GELU's input's size
    assert beside.after == beside.outside and beside.block_gradients == 2 * 64 * 256 * 4, beside
    assert strategy.activation_plan.peak_bytes >= beside.bytes


def test_the_layout_leaves_room_for_the_backward_s_gradients(tmp_path):
    """Cross-entropy's backward makes the gradients of the log-softmax and of the logits, 256 KiB
    each at batch 64, while everything the forward saved is still held; the plan counted the saved
    memory alone. In a 1.5 MiB tier it laid the blocks out beside 650 KiB of parameters, and the
    backward's peak (measured on the CPU: the saved memory and 507 KiB beyond it) came to 1.09x
    the tier. Now twice the largest saved tensor is planned beside every layout: at 1.5 MiB the
    run stops before any update with the minimum, and that minimum trains like plain, every step
    within it with the gradients counted."""
    from tests.test_backward_gradients import backward_beyond_forward

    model = Classes()
    model.losses = []
    batch = (torch.randn(64, 64), torch.randn(64, 1))
    measured, planned = backward_beyond_forward(model, lambda: model.training_step(batch, 0))
    assert planned == 2 * 64 * 1024 * 4 and measured > 0.95 * planned
    with pytest.raises(ValueError, match=r"no layout of keep / checkpoint / swap fits") as refused:
        fit(TieredStrategy(gpu_memory=1536 * 1024, host_memory="256MiB"), tmp_path / "refused", batch=64, steps=6, make=Classes)
    message = str(refused.value)
    assert "measured in the first training step before any update" in message, message
    assert "512.00 KiB for the backward's gradients" in message and "272.50 KiB of activations outside the blocks" in message
    # By hand. A block keeps 147,456 bytes, a recomputed block's input 16,384; what the head saved
    # (279,044: all of it after the blocks) and its gradients (524,288) are held at the head's
    # backward, a block's gradients (131,072: twice the GELU's input) at each block's. The first
    # steps' layout at the head's backward: 147,456 + 7 x 16,384 + 279,044 + (524,288 - 131,072)
    # = 934,404, with the blocks' 131,072 beside: 1,065,476; after the first block's forward it
    # counted 8,192 bytes a sample (the first block, six inputs, the last block and the ReLU's
    # gradients) and let the step go on.
    assert "the smallest peak is 1,065,476 bytes" in message, message
    assert named_share(message) == 85.1  # 1.5 MiB less 649.5 KiB of buffers (907,776 bytes) over 1,065,476
    budget = named_gpu_memory(message)
    assert 0 <= budget - (665_088 + 1_065_476) < 0.01 * 2**20  # named to the hundredth of a MiB above
    plain = fit("auto", tmp_path / "plain", batch=64, steps=6, make=Classes)
    held = HeldInTheGpuTier()
    tiered = fit(TieredStrategy(gpu_memory=budget, host_memory="256MiB"), tmp_path / "tiered", batch=64, steps=6, callbacks=(held,),
                 make=Classes)
    assert tiered.losses == plain.losses
    assert_same_weights(plain.state_dict(), tiered.state_dict())
    assert all(saved + parameters + planned <= budget for _, saved, parameters in held.steps), held.steps
