"""No test depends on code outside the package: a test imports ``offload_strategy`` (its ``demos``
for the model the tests train) and runs the Hydra job and the tools as a user does, as
subprocesses. The scan reads every import of every file under tests/, at any depth."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
OUTSIDE = ("tools", "experiments")


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``; ``from tools import simulate`` as ``tools.simulate``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names if node.module in OUTSIDE]
    return found


def outside(path: Path) -> list[str]:
    """The imports of code outside the package in ``path``."""
    return [f"{path.name}:{line} imports {module}" for line, module in imported(path) if module.split(".")[0] in OUTSIDE and module not in OUTSIDE]


def test_no_test_imports_the_tools_or_the_experiments():
    hits = [hit for path in sorted(TESTS.rglob("*.py")) for hit in outside(path)]
    assert not hits, "tests import code outside the package; run the script as a subprocess, or move the logic into offload_strategy:\n" + "\n".join(hits)


def test_the_scan_sees_every_form_of_import(tmp_path):
    source = tmp_path / "case.py"
    source.write_text("import tools.compare\nfrom experiments.train import run\n\ndef f():\n    from tools import compare_peers, simulate\n"
                      "    import offload_strategy.demos\n    from tools.plan import show\n")
    assert outside(source) == ["case.py:1 imports tools.compare", "case.py:2 imports experiments.train", "case.py:5 imports tools.compare_peers",
                               "case.py:5 imports tools.simulate", "case.py:7 imports tools.plan"]
