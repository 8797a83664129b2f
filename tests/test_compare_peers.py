"""tools/compare_peers.py as a user runs it: each row in a process of its own, a row that cannot
run on this machine a line that says why, never a crash of the whole table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def compare_peers(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "tools/compare_peers.py"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_dry_run_on_the_cpu_prints_every_row_and_a_failed_row_the_end_of_its_error_output():
    """A GPU out-of-memory message runs to several lines; the table keeps 160 characters of one."""
    done = compare_peers("--model", "gpt2_tiny", "--accelerator", "cpu", "--rows", "lightning", "tiered", "fsdp_offload", "--steps", "2",
                         "--warmup", "0", "--seq-len", "32", "--batch-size", "2", "--precision", "32-true")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert "failed" not in rows["lightning"] and "failed" not in rows["tiered"]
    assert rows["tiered"].rstrip().endswith("| 1.00 |")  # the reference of the last column
    assert "failed" in rows["fsdp_offload"] and "GPU" in rows["fsdp_offload"]  # FSDP's offload needs CUDA: said, not raised
    assert "fsdp_offload failed (exit 1); the end of its error output:" in done.stderr
    assert "the peers recompute every block" in done.stdout


def test_an_unknown_model_names_the_known_ones():
    done = compare_peers("--model", "gpt2_huge", "--rows", "lightning")
    assert done.returncode == 1 and "--model gpt2_huge: no conf/model/gpt2_huge.yaml; choose one of" in done.stderr and "gpt2_tiny" in done.stderr


def test_a_sequence_longer_than_the_model_s_positions_is_refused_before_any_row():
    """The docstring's dry run used the default --seq-len 1024 on gpt2_tiny (256 positions): every
    row failed with an index error from the position embedding."""
    done = compare_peers("--model", "gpt2_tiny", "--accelerator", "cpu", "--rows", "lightning")
    assert done.returncode == 1 and "lightning ..." not in done.stderr  # no row ran
    assert "--seq-len 1024 is longer than gpt2_tiny's 256 positions; pass --seq-len 256 or less" in done.stderr
