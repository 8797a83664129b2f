"""``make gpu-check`` (tools/gpu_check.sh) on a machine without a GPU: every part says so in one
line and exits 2, having checked nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PARTS = ["all", "tests", "probe", "bench", "peers"]


def _gpu_check(out: Path, part: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), str(out), part], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable}, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the parts run")
@pytest.mark.parametrize("part", PARTS)
def test_every_part_exits_2_with_one_line_where_there_is_no_gpu(tmp_path, part):
    done = _gpu_check(tmp_path, part)
    assert done.returncode == 2, done
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and part in lines[0], done.stdout
    assert (tmp_path / "summary.txt").read_text().splitlines() == lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.txt"]  # nothing ran


def test_an_unknown_part_is_refused_with_the_parts_there_are(tmp_path):
    done = _gpu_check(tmp_path, "everything")
    assert done.returncode == 1 and "unknown part 'everything'" in done.stderr and "tests|probe|bench|peers" in done.stderr, done
