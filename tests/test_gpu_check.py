"""``make gpu-check`` (tools/gpu_check.sh) on a machine without a GPU: every part says so in one
line and exits 2, having checked nothing; so does each part's script run on its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PARTS = ["all", "tests", "probe", "bench", "race", "timeline", "memory", "peers-a", "peers-b"]
SCRIPTS = {"race": "tools/gpu_race.py", "timeline": "tools/gpu_timeline.py", "memory": "tools/gpu_memory.py"}
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the parts run")


def _gpu_check(out: Path, part: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), str(out), part], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable}, timeout=120)


@no_gpu
@pytest.mark.parametrize("part", PARTS)
def test_every_part_exits_2_with_one_line_where_there_is_no_gpu(tmp_path, part):
    done = _gpu_check(tmp_path, part)
    assert done.returncode == 2, done
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and part in lines[0], done.stdout
    assert (tmp_path / "summary.txt").read_text().splitlines() == lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.txt"]  # nothing ran


@no_gpu
@pytest.mark.parametrize("part", sorted(SCRIPTS))
def test_each_part_s_script_run_alone_exits_2_with_one_line_where_there_is_no_gpu(tmp_path, part):
    done = subprocess.run([sys.executable, str(ROOT / SCRIPTS[part])], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert done.stdout.splitlines() == [f"gpu-check {part}: no CUDA GPU on this machine, nothing checked (the CPU suite is 'make test')."], done
    assert not list(tmp_path.iterdir())


def test_an_unknown_part_is_refused_with_the_parts_there_are(tmp_path):
    done = _gpu_check(tmp_path, "everything")
    assert done.returncode == 1 and "unknown part 'everything'" in done.stderr, done
    assert "tests|probe|bench|race|timeline|memory|peers-a|peers-b" in done.stderr, done.stderr


def test_the_docs_and_the_makefile_name_every_part():
    docs, make = (ROOT / "docs/gpu.md").read_text(), (ROOT / "Makefile").read_text()
    assert not [part for part in PARTS if f"`{part}`" not in docs and f"PART={part}" not in docs], "docs/gpu.md misses parts"
    assert not [part for part in PARTS if re.search(rf"[ ,(]{re.escape(part)}[ ,)]", make) is None], "the Makefile's note on PART misses parts"
