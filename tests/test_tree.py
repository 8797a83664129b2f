"""The package's shape, as docs/architecture.md draws it: a few modules at the top, each job in a
folder of its own, no class a reader cannot hold, and mypy over all of it."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "offload_strategy"
LONGEST_CLASS = 600  # lines


def test_the_package_top_level_holds_at_most_five_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in {"__init__.py", "__main__.py"})
    assert len(modules) <= 5, f"{len(modules)} modules at the package's top level ({', '.join(modules)}): give each job a folder"


def test_every_folder_named_in_the_architecture_exists():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    expected = {"lightning", "session", "planning", "runtime", "memory", "hardware", "construction", "checkpoint", "estimate", "demos"}
    assert expected <= folders, f"missing: {sorted(expected - folders)}"
    runtime = {p.name for p in (PACKAGE / "runtime").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {"params", "grads", "updates", "activations"} <= runtime


def test_no_class_is_longer_than_a_reader_can_hold():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_CLASS:
                    long.append(f"{path.relative_to(ROOT)}::{node.name} ({lines} lines)")
    assert not long, f"classes over {LONGEST_CLASS} lines: {long}; split a job out into a collaborator"


def test_mypy_checks_the_whole_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["files"] == ["offload_strategy"], config["files"]
