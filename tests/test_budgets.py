"""Budgets: the memory a control group allows (v1, v2, nested), the emulated GPU tier and host
memory checked against the same memory, and one count of each budget at set-up and after the
profiled steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from offload_strategy import TieredStrategy
from offload_strategy.config import BlockPolicy
from offload_strategy.hardware import cgroup as cgroup_module
from offload_strategy.hardware import probe
from offload_strategy.hardware.cgroup import CgroupMemory, cgroup_memory
from offload_strategy import MemoryBudgetError
from tests.helpers import train

ROOT = Path(__file__).resolve().parents[1]
GiB, MiB = 2**30, 2**20


def _write(directory: Path, **files: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (directory / name.replace("_", ".", 1)).write_text(f"{value}\n")


def _tree(tmp_path: Path, proc: str) -> tuple[Path, Path]:
    (tmp_path / "proc").write_text(proc)
    return tmp_path / "proc", tmp_path / "cgroup"


# -- the reader, over fake cgroup trees ----------------------------------------------------------------


def test_v2_limit_and_use(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "0::/job\n")
    _write(root / "job", memory_max=3 * GiB, memory_current=GiB)
    _write(root / "job", memory_stat="anon 100\ninactive_file 4096\nactive_file 8192")
    group = cgroup_memory(proc, root)
    assert group == CgroupMemory(limit=3 * GiB, usage=GiB - 4096, group=root / "job")
    assert group.free == 2 * GiB + 4096


def test_v2_max_is_no_limit(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "0::/job\n")
    _write(root / "job", memory_max="max", memory_current=GiB)
    assert cgroup_memory(proc, root) is None


def test_v2_nested_takes_the_tightest(tmp_path: Path) -> None:
    # the parent's limit is larger, but its other children hold most of it
    proc, root = _tree(tmp_path, "0::/slurm/job_7/step_0\n")
    _write(root / "slurm", memory_max=8 * GiB, memory_current=7 * GiB)
    _write(root / "slurm" / "job_7", memory_max=4 * GiB, memory_current=GiB)
    _write(root / "slurm" / "job_7" / "step_0", memory_max="max", memory_current=GiB)
    group = cgroup_memory(proc, root)
    assert group is not None and group.group == root / "slurm" and group.free == GiB


def test_v2_the_root_of_a_container(tmp_path: Path) -> None:
    # under a cgroup namespace the process's group is shown as "/" and is the mount's root
    proc, root = _tree(tmp_path, "0::/\n")
    _write(root, memory_max=3 * GiB, memory_current=GiB // 2)
    group = cgroup_memory(proc, root)
    assert group is not None and group.free == 3 * GiB - GiB // 2


def test_v1_limit_and_use(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "9:name=systemd:/\n4:memory:/docker/abc\n3:cpuset:/\n0::/\n")
    _write(root / "memory" / "docker" / "abc", memory_limit_in_bytes=3 * GiB, memory_usage_in_bytes=GiB)
    _write(root / "memory" / "docker" / "abc", memory_stat="cache 10\ntotal_inactive_file 1024\ninactive_file 7")
    _write(root / "memory", memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=20 * GiB)
    group = cgroup_memory(proc, root)
    assert group == CgroupMemory(limit=3 * GiB, usage=GiB - 1024, group=root / "memory" / "docker" / "abc")


def test_v1_unlimited_everywhere(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "4:memory:/docker/abc\n")
    _write(root / "memory" / "docker" / "abc", memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=GiB)
    _write(root / "memory", memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=GiB)
    assert cgroup_memory(proc, root) is None


def test_v1_nested_in_a_combined_mount(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "5:cpu,memory:/batch/job\n")
    _write(root / "cpu,memory" / "batch", memory_limit_in_bytes=2 * GiB, memory_usage_in_bytes=GiB)
    _write(root / "cpu,memory" / "batch" / "job", memory_limit_in_bytes=6 * GiB, memory_usage_in_bytes=GiB)
    group = cgroup_memory(proc, root)
    assert group is not None and group.limit == 2 * GiB and group.free == GiB


def test_no_cgroup_files(tmp_path: Path) -> None:
    assert cgroup_memory(tmp_path / "missing", tmp_path) is None
    proc, root = _tree(tmp_path, "0::/job\n")
    assert cgroup_memory(proc, root) is None  # nothing mounted there


def test_host_available_is_the_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "cgroup_memory", lambda: CgroupMemory(limit=3 * GiB, usage=GiB, group=Path("/job")))
    assert probe.host_available() <= 2 * GiB
    assert probe.host_total() <= 3 * GiB
    assert probe.probe_hardware().host_memory <= 3 * GiB


def test_a_budget_above_the_groups_room_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(probe, "cgroup_memory", lambda: CgroupMemory(limit=3 * GiB, usage=GiB, group=Path("/job")))
    with pytest.raises(MemoryBudgetError, match=r"host_memory=2\.50 GiB asks for more than is free in host memory: 2\.00 GiB free"):
        train(TieredStrategy(gpu_memory="1MiB", host_memory="2.5GiB"), tmp_path, epochs=1)


# -- the emulated GPU tier and host memory, one memory ----------------------------------------------


def test_emulated_gpu_tier_and_host_memory_checked_together(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(probe, "cgroup_memory", lambda: CgroupMemory(limit=23 * GiB, usage=0, group=Path("/job")))
    monkeypatch.setattr(probe.psutil, "virtual_memory", lambda: _Memory(total=24 * GiB, available=23 * GiB))
    with pytest.raises(MemoryBudgetError) as refused:
        train(TieredStrategy(gpu_memory="20GiB", host_memory="20GiB"), tmp_path, epochs=1)
    message = str(refused.value)
    assert "40.00 GiB together" in message and "23.00 GiB is available" in message
    assert "host_memory=3.00 GiB beside this gpu_memory" in message  # the fix, with its number


def test_an_unbounded_budget_takes_what_the_other_leaves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(probe, "cgroup_memory", lambda: None)
    monkeypatch.setattr(probe.psutil, "virtual_memory", lambda: _Memory(total=24 * GiB, available=23 * GiB))
    strategy = TieredStrategy(gpu_memory="20GiB", host_memory=None, policy="none")
    train(strategy, tmp_path, epochs=1, limit_train_batches=1)
    assert (strategy.budgets.gpu, strategy.budgets.host) == (20 * GiB, 3 * GiB)


class _Memory:
    def __init__(self, total: int, available: int) -> None:
        self.total, self.available = total, available


# -- a job in a real child cgroup --------------------------------------------------------------------


def _own_memory_group() -> Optional[tuple[Path, str]]:
    """This process's memory cgroup directory and the name of its limit file, where both are there."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found = cgroup_module._memory_hierarchy(lines, cgroup_module.CGROUP_ROOT)
    if found is None:
        return None
    _mount, group, layout = found
    return (group, layout.limit) if (group / layout.limit).exists() else None


def test_a_job_in_a_real_child_cgroup(tmp_path: Path) -> None:
    own = _own_memory_group()
    if own is None:
        pytest.skip("no memory cgroup to make a child in")
    parent, limit_file = own
    child = parent / f"offload-test-{os.getpid()}"
    try:
        child.mkdir()
    except OSError as error:
        pytest.skip(f"cannot make a child cgroup under {parent}: {error}")
    limit = 2 * GiB
    try:
        try:
            (child / limit_file).write_text(str(limit))
        except OSError as error:
            pytest.skip(f"cannot set a memory limit in {child}: {error}")
        job = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "cgroup_job.py"), str(tmp_path), str(limit)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
            preexec_fn=lambda: (child / "cgroup.procs").write_text("0"),
        )
        out, err = job.communicate(timeout=300)
    finally:
        child.rmdir()
    assert job.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["limit"] == limit
    assert 0 < result["available"] < limit
    assert result["granted"] < limit  # host_memory=None: what the group leaves, not the machine
    assert "asks for more than is free in host memory" in result["over_limit"]
    assert len(result["losses"]) > 0


# -- one count of host memory and NVMe, at set-up and after the profiled steps ------------------------

FOUR_LAYERS = {"n_layer": 4}


def _config() -> dict:
    from tests.helpers import TINY_GPT2

    return {**TINY_GPT2, **FOUR_LAYERS}


def _same_as_plain(strategy: TieredStrategy, tmp_path: Path) -> None:
    from tests.helpers import assert_same_weights

    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, config=_config())
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, config=_config())
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_host_memory_accepted_at_set_up_holds_after_the_profiled_steps(tmp_path: Path) -> None:
    # everything fits the GPU tier at set-up; the measured activations then push the parameters
    # out. The placement in the parameters' fewest buffers needs 940 KiB of host memory; 560 KiB
    # was accepted at set-up and stopped the run after 3 steps. The parameters now keep the share
    # host memory can hold the rest of, and the layout fits beside it. (At 1 MiB the profiled
    # steps, with every parameter in the GPU tier, held 1.24 MiB of it; streamed while they measure,
    # the first step refuses 1 MiB before any update and names 1.09 MiB: it counts their layout
    # beside the share the later plans need at least, 651.92 KiB here, not the 547.50 KiB they use.)
    _same_as_plain(TieredStrategy(gpu_memory="1120KiB", host_memory="560KiB"), tmp_path)


def test_host_memory_that_cannot_hold_a_layout_is_refused_before_any_update(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"first block's forward of the first training step") as refused:
        train(TieredStrategy(gpu_memory="1MiB", host_memory="470KiB"), tmp_path / "refused", epochs=1, config=_config())
    message = str(refused.value)
    assert "host_memory=470.00 KiB and nvme_memory=0 B hold the rest of the parameters only beside" in message
    named = message.split("gpu_memory must be at least ")[1].split(" (it is")[0]
    # the number it names works
    _same_as_plain(TieredStrategy(gpu_memory=named, host_memory="470KiB"), tmp_path)


def test_nvme_budget_accepted_at_set_up_holds_after_the_profiled_steps(tmp_path: Path) -> None:
    # 600 KiB of NVMe accepted at set-up, then 800 KiB asked for after 3 steps; and a layout that
    # swapped more to NVMe than the placement left of the budget
    strategy = TieredStrategy(gpu_memory="1MiB", host_memory="400KiB", nvme_path=tmp_path / "nvme", nvme_memory="600KiB")
    _same_as_plain(strategy, tmp_path)


def test_the_swap_store_asks_for_what_the_layout_swaps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # the NVMe budget is all that was free at set-up; by the time the layout swaps to NVMe the
    # disk has 2 MiB free, more than the 677 KiB the swapped blocks need
    from lightning.pytorch.callbacks import Callback

    from offload_strategy.memory import nvme

    class DiskFillsUp(Callback):
        swapped: list[tuple[float, int]] = []

        def on_train_start(self, trainer, pl_module) -> None:
            monkeypatch.setattr(nvme, "disk_free", lambda path: 2 * MiB)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            store = strategy.tiered.activations.swap_store
            if store is not None:
                self.swapped.append((strategy.metrics(reset=False)["activations/swapped_nvme_bytes"], store.capacity))

    strategy = TieredStrategy(gpu_memory="1MiB", host_memory="300KiB", nvme_path=tmp_path / "nvme")
    watch = DiskFillsUp()
    losses, _, _ = train(strategy, tmp_path, epochs=1, config=_config(), extra_callbacks=(watch,))
    assert len(losses) == 6
    assert watch.swapped and all(0 < swapped <= capacity < 2 * MiB for swapped, capacity in watch.swapped)


# -- the longest batch, named up front ---------------------------------------------------------------

LONGEST = 32


def _dynamic_padding() -> list:
    """Six batches of 4 sequences, the fifth four times as long as the others (dynamic padding)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (4, n), generator=generator) for n in (8, 8, 8, 8, LONGEST, 8)]


def _fit_padded(strategy, root: Path) -> tuple[list[float], dict, list[str]]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from offload_strategy.demos import CausalLM
    from tests.helpers import LossRecorder

    class Layouts(Callback):
        """The activation layout in place at each step."""

        def __init__(self) -> None:
            self.seen: list[str] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if isinstance(trainer.strategy, TieredStrategy):
                self.seen.append("".join(BlockPolicy(p).letter for p in trainer.strategy.tiered.activations.policies))

    L.seed_everything(7, verbose=False)
    model = CausalLM(family="gpt2", config=_config(), lr=1e-2, warmup_steps=2)
    recorder, layouts = LossRecorder(), Layouts()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root, callbacks=[recorder, layouts],
    )
    trainer.fit(model, train_dataloaders=DataLoader(_dynamic_padding(), batch_size=None))
    return recorder.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, layouts.seen


def _longest_batch():
    import torch

    return torch.zeros(4, LONGEST, dtype=torch.long)


def test_max_batch_refuses_in_the_first_step_what_a_longer_batch_would_stop_later(tmp_path: Path) -> None:
    # without a bound, the layout planned for the short batches meets the long one at step 5,
    # after four updates, and no layout fits it there
    recorded: list = []
    with pytest.raises(ValueError, match="scaled from the measured blocks to a batch whose blocks' inputs are 4.00x theirs"):
        recorded.append(_fit_padded(TieredStrategy(gpu_memory="600KiB"), tmp_path / "unbounded"))
    # with it, the same budget is refused in the first step's forward, before any update
    with pytest.raises(ValueError, match=r"first block's forward of the first training step .*scaled 4\.00x to max_batch") as refused:
        _fit_padded(TieredStrategy(gpu_memory="600KiB", max_batch=_longest_batch()), tmp_path / "bounded")
    named = str(refused.value).split("gpu_memory must be at least ")[1].split(" (it is")[0]
    # and the gpu_memory it names holds every batch, with one layout from the first plan on
    from tests.helpers import assert_same_weights

    plain_losses, plain_weights, _ = _fit_padded("auto", tmp_path / "plain")
    losses, weights, layouts = _fit_padded(TieredStrategy(gpu_memory=named, max_batch=_longest_batch()), tmp_path / "named")
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert len(set(layouts[3:])) == 1, layouts  # laid out once, after the three profiled steps, never again


def test_a_batch_beyond_max_batch_is_refused(tmp_path: Path) -> None:
    import torch

    with pytest.raises(ValueError, match=r"a training batch holds 128 tensor elements, more than the 64 of max_batch"):
        _fit_padded(TieredStrategy(gpu_memory="2MiB", max_batch={"input_ids": torch.zeros(4, 16, dtype=torch.long)}), tmp_path)


def test_max_batch_must_hold_a_tensor() -> None:
    with pytest.raises(ValueError, match="max_batch=str holds no tensor"):
        TieredStrategy(max_batch="longest")


def test_max_batch_under_fabric_bounds_the_models_inputs() -> None:
    import torch

    from offload_strategy import TieredFabricStrategy
    from tests.test_fabric import BATCH, SEQ, fabric_train

    half = torch.zeros(BATCH, SEQ // 2, dtype=torch.long)
    elements = 2 * BATCH * SEQ  # input_ids and labels
    with pytest.raises(ValueError, match=f"a training batch holds {elements:,} tensor elements, more than the {elements // 2:,} of max_batch"):
        fabric_train(TieredFabricStrategy(gpu_memory="2MiB", max_batch={"input_ids": half, "labels": half}), steps=1)


@pytest.mark.parametrize("planner", ["auto", "lohan"])
def test_layouts_swap_to_nvme_only_what_its_budget_leaves(planner: str) -> None:
    from offload_strategy.planning.activations import BlockCost, Links, nvme_swapped_bytes
    from offload_strategy.planning.planner import layout_for

    # swapping is far faster than recomputing here: with NVMe room, every block but the last goes there
    costs = [BlockCost(activation_bytes=MiB, input_bytes=MiB // 64, forward_seconds=1.0) for _ in range(8)]
    fast = dict(h2d=1e12, d2h=1e12, nvme_read=1e12, nvme_write=1e12)
    lay_out = layout_for(planner)
    unbounded = lay_out(costs, Links(**fast), gpu_bytes=3 * MiB, host_bytes=0)
    assert nvme_swapped_bytes(costs, unbounded.layout) > 2 * MiB
    bounded = lay_out(costs, Links(**fast, nvme_room=2 * MiB), gpu_bytes=3 * MiB, host_bytes=0)
    assert 0 < nvme_swapped_bytes(costs, bounded.layout) <= 2 * MiB
