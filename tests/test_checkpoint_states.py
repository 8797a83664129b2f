"""The checkpoint states (``checkpoint/states.py``) beside the strategies' core: one object per
strategy, reached from its hooks, calls going one way, and its choice surviving a pickle."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from offload_strategy import TieredStrategy
from offload_strategy.checkpoint.states import CheckpointStates
from offload_strategy.config import StateDictType
from offload_strategy.lightning.core import TieredCore

PACKAGE = Path(__file__).resolve().parents[1] / "offload_strategy"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth, relative ones by their last part."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out.add(node.module or "")
            out.update(f"{node.module}.{alias.name}" if node.module else alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_the_checkpoint_states_never_call_the_core_or_the_strategies():
    imports = imported_modules(PACKAGE / "checkpoint" / "states.py")
    upward = sorted(m for m in imports if m.split(".")[-1] in {"core", "strategy", "ddp", "fabric", "hooks"})
    assert not upward, f"checkpoint/states.py imports {upward}: the core holds the checkpoint states, not the other way"


def test_the_core_stays_under_600_lines():
    tree = ast.parse((PACKAGE / "lightning" / "core.py").read_text())
    core = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TieredCore")
    lines = core.end_lineno - core.lineno + 1
    assert lines < 600, f"TieredCore is {lines} lines: give a job of its own to a collaborator (as CheckpointStates has)"


@pytest.mark.parametrize("kind", ["full", "sharded", "auto"])
def test_the_strategy_reads_and_pickles_the_checkpoint_states_choice(kind):
    strategy = TieredStrategy(state_dict_type=kind)
    assert isinstance(strategy.tiered.checkpoints, CheckpointStates)
    assert strategy.state_dict_type is StateDictType(kind)
    again = pickle.loads(pickle.dumps(strategy))
    assert isinstance(again.tiered, TieredCore) and again.tiered is not strategy.tiered
    assert again.state_dict_type is StateDictType(kind)
    # a fresh core with fresh checkpoint states, sharing its own context and deferred parameters
    assert again.tiered.checkpoints.context is again.tiered.context
    assert again.tiered.checkpoints.deferred is again.tiered.deferred
