"""The code habits CI holds the repository to: ruff's pyflakes and pycodestyle rules, a line
length and a complexity limit on every function (``[tool.ruff]`` in pyproject.toml), and mypy on
the package (``[tool.mypy]``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, f"ruff check (run `make lint` to see it alone):\n{result.stdout}{result.stderr}"


@pytest.mark.slow  # about a minute: it reads torch's own annotations
def test_mypy_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"mypy (run `make lint` to see it alone):\n{result.stdout}{result.stderr}"
