"""The GPU check's race, timeline and memory parts (tools/gpu_race.py, gpu_timeline.py,
gpu_memory.py) as a user runs them, with the hidden ``--device cpu`` that runs the same code on the
emulated device at tiny sizes: so that a GPU, when one is lent, runs scripts that have run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload_strategy.config import parse_size

ROOT = Path(__file__).resolve().parent.parent
TINY_GPT2 = ["--layers", "2", "--width", "64", "--seq-len", "32", "--batch-size", "4"]


def run(script: str, *args: str, cwd: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / script), "--device", "cpu", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.splitlines()


def table(lines: list[str], first: str) -> list[list[str]]:
    """The rows of the markdown table whose header's first cell is ``first``, as cells."""
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@pytest.mark.slow
def test_the_race_part_trains_twice_under_the_race_check_and_finds_the_same_bits(tmp_path):
    """Four blocks on NVMe, two frozen; the first run under the emulated device's race check
    (copies land late; a host access before its wait raises), the second in a child process."""
    lines = run("gpu_race.py", "--blocks", "4", "--width", "64", "--batch", "32", "--nvme-path", str(tmp_path), cwd=tmp_path)
    assert lines[-3].endswith(", under the emulated device's race check"), lines[-3]
    first, second = (line.split("losses ")[1].split("]")[0] for line in lines[-3:-1])
    assert first == second and first.count(",") == 2, lines  # three losses, the same digits
    assert lines[-1].startswith("race: none seen: 3 losses and 8 tensors the same bits as under CUDA_LAUNCH_BLOCKING=1"), lines[-1]
    assert "4 blocks of 16.25 KiB (2 frozen)" in lines[-1] and "units gpu/host/nvme 0/0/4" in lines[-1], lines[-1]
    assert not list(tmp_path.glob("race-nvme-*"))  # the NVMe files are gone


@pytest.mark.slow
def test_the_timeline_part_times_every_unit_beside_the_profiler_and_finds_the_copy_lanes(tmp_path):
    lines = run("gpu_timeline.py", *TINY_GPT2, cwd=tmp_path)
    lanes = {row[0]: row[1] for row in table(lines, "lane")}
    assert list(lanes.values()).count("compute") == 1 and "copy" in lanes.values(), lanes  # the emulated links' threads
    units = table(lines, "unit")
    assert len(units) == 15 and units[0][0] == "model.transformer.wte", units  # every unit of the 2-layer GPT-2, in order
    # every unit's forward, timed by both (the engine's marks, the profiler's operators in them)
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in units), units
    assert sum(float(row[5]) > 0 for row in units) >= 12, units  # and the backward of those that have one
    assert lines[-1].startswith("timeline: compute ") and "of 15 within 10%" in lines[-1], lines[-1]


@pytest.mark.slow
def test_the_memory_part_counts_each_step_under_both_precisions_across_a_replacement(tmp_path):
    lines = run("gpu_memory.py", *TINY_GPT2, "--gpu-memory", "1400KiB", "--steps", "3", "--replace-after", "2", cwd=tmp_path)
    rows = table(lines, "precision")
    assert [row[:2] for row in rows] == [[p, s] for p in ("32-true", "bf16-mixed") for s in ("1", "2", "placed again", "3")], rows
    steps = [row for row in rows if row[1] != "placed again"]
    assert all(row[2:5] == ["-", "-", "-"] for row in steps), steps  # no CUDA allocator on the CPU
    # each engine's arena, the same after the re-placement (from step 2: after step 1 the parameters
    # may be placed again beside the fixed layout's measured peak)
    for precision in ("32-true", "bf16-mixed"):
        arenas = {row[5] for row in steps if row[0] == precision and row[1] != "1"}
        assert len(arenas) == 1 and "0.00 B" not in arenas, steps
    # every block checkpointed is a layout the user fixed, counted in gpu_memory as a planned one:
    # the parameters as placed beside the blocks' inputs, the head's activations and the gradients
    for row in steps:
        parameters, activations, plan, budget = (parse_size(cell) for cell in row[6:10])
        # (each cell rounded to three figures)
        assert 0 < activations and abs(plan - parameters - activations) <= 0.005 * plan and abs(budget - parse_size("1400KiB")) <= 0.005 * budget, row
        # within gpu_memory once the first step measured the fixed layout and placed the parameters beside it
        assert row[1] == "1" or plan <= budget, row
    assert lines[-1].startswith("memory: 32-true peak - allocated") and "; bf16-mixed peak" in lines[-1], lines[-1]
