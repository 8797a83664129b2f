"""Who may change the planning state, checked on the source: a planner's attributes are assigned
only inside ``planning/`` (what it is given arrives as constructor inputs or method arguments),
the activation control's searched layout only by the activation control, and the speculation's
room only by the runtime. The core asks the planning session; it writes none of them."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "offload_strategy"


def _planner_fields() -> set[str]:
    """The attributes ``Planner`` gives itself (``self.x = ...`` in its methods)."""
    tree = ast.parse((PACKAGE / "planning" / "planner.py").read_text())
    planner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Planner")
    return {t.attr for t in _assigned(planner) if isinstance(t.value, ast.Name) and t.value.id == "self"}


def _assigned(tree: ast.AST) -> list[ast.Attribute]:
    """Every attribute assigned in ``tree`` (plain, augmented, annotated, in tuples)."""
    targets: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets += node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets.append(node.target)
    found = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets += target.elts
        elif isinstance(target, ast.Attribute):
            found.append(target)
    return found


def _holder(target: ast.Attribute) -> str:
    """The last name of the object whose attribute is assigned (``self.context.planner.x``: ``planner``)."""
    value = target.value
    if isinstance(value, ast.Attribute):
        return value.attr
    return value.id if isinstance(value, ast.Name) else ""


def _sources() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tools").glob("*.py"), *(ROOT / "tests").glob("*.py")])


@functools.lru_cache(maxsize=None)
def _assigned_in(path: Path) -> tuple[ast.Attribute, ...]:
    return tuple(_assigned(ast.parse(path.read_text())))


def _writes(path: Path, holder_says: str, fields: set[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{t.lineno} assigns {_holder(t)}.{t.attr}"
        for t in _assigned_in(path)
        if t.attr in fields and holder_says in _holder(t).lower()
    ]


def test_the_scan_finds_a_planner_attribute_assigned_from_outside():
    """The check itself: assignments as the core used to write them are found."""
    tree = ast.parse("def f(self, planner, model):\n    planner.model = model\n    self.context.planner.resident, x = None, 1\n")
    found = [(_holder(t), t.attr) for t in _assigned(tree) if t.attr in _planner_fields()]
    assert sorted(found) == [("planner", "model"), ("planner", "resident")]


def test_nothing_outside_planning_assigns_a_planners_attributes():
    fields = _planner_fields()
    assert {"model", "resident", "gpu_placed", "host_reserve"} <= fields  # what the scan looks for
    outside = [p for p in _sources() if PACKAGE / "planning" not in p.parents]
    assert [w for p in outside for w in _writes(p, "planner", fields)] == []


def test_only_the_activation_control_sets_its_searched_layout_and_only_the_runtime_the_speculation_room():
    control = PACKAGE / "session" / "activations.py"
    runtime = PACKAGE / "runtime"
    searched = [w for p in _sources() if p != control for w in _writes(p, "", {"searched"})]
    room = [w for p in _sources() if runtime not in p.parents for w in _writes(p, "speculation", {"room"})]
    assert searched == [] and room == []
