"""The README's examples run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def example(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert found, f"README.md has no example marked {name!r}"
    return found.group(1)


def run_script(text: str, where: Path) -> subprocess.CompletedProcess:
    """``text`` run as a user runs an example they pasted into a file, which must succeed."""
    script = where / "example.py"
    script.write_text(text)
    result = subprocess.run([sys.executable, str(script)], cwd=where, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_cpu_example_trains_with_offloaded_units(tmp_path):
    result = run_script(example("cpu"), tmp_path)
    streamed = re.search(r"^([\d.]+) units streamed from host memory$", result.stdout, re.M)
    assert streamed and float(streamed.group(1)) > 0, result.stdout[-2000:]


def test_when_nothing_needs_offloading_one_line_says_so(tmp_path):
    result = run_script(example("cpu").replace('gpu_memory="1MiB"', 'gpu_memory="1GiB"'), tmp_path)
    said = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("tiered: everything fits")]
    assert len(said) == 1 and "nothing is offloaded" in said[0], result.stderr[-2000:]
    assert "0 units streamed" in result.stdout or "units streamed" not in result.stdout


def test_the_fabric_example_trains_offloaded_and_saves_a_checkpoint_plain_torch_reads(tmp_path):
    result = run_script(example("fabric"), tmp_path)
    streamed = re.search(r"^(\d+) bytes streamed from host memory$", result.stdout, re.M)
    assert streamed and int(streamed.group(1)) > 0, result.stdout[-2000:]
    import torch

    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["step"] == 9 and checkpoint["model"]["0.weight"].shape == (256, 256)
    assert len(checkpoint["optimizer"]["state"]) == 16, "the optimizer's states are not all in the checkpoint"


def test_the_gpu_check_says_when_there_is_no_gpu_and_writes_its_folder(tmp_path):
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("a GPU is here: make gpu-check runs the checks themselves")
    out = tmp_path / "gpu-check"
    env = {**__import__("os").environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no CUDA GPU on this machine" in result.stdout, result.stdout + result.stderr
    assert "available False" in (out / "environment.txt").read_text() and "make test" in (out / "summary.txt").read_text()
