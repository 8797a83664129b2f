"""Each field of a unit's run-time state has one owner: it is assigned in exactly one module of the
package, through that module's named transitions (docs/architecture.md, "Who changes a unit").

Read statically: every assignment and augmented assignment in ``offload_strategy/`` whose target is
an attribute named after a field of ``UnitState``, ``GradientRecord`` or ``StepState``, on an
expression that holds one (see :func:`holder`), is attributed to its module.
"""

from __future__ import annotations

import ast
import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Optional

from offload_strategy.runtime.context import StepState
from offload_strategy.runtime.grads.path import GradientRecord
from offload_strategy.runtime.state import UnitState

PACKAGE = Path(__file__).resolve().parents[1] / "offload_strategy"

# the names under which the package's code holds each kind of state (a parameter annotated with the
# class counts too, whatever its name)
HOLDERS: dict[str, set[str]] = {
    "UnitState": {"s", "state", "ready", "victim", "unit_state"},
    "GradientRecord": {"record", "r"},
    "StepState": {"step"},
}
CLASSES = {"UnitState": UnitState, "GradientRecord": GradientRecord, "StepState": StepState}


def fields(kind: str) -> set[str]:
    return {f.name for f in dataclasses.fields(CLASSES[kind])}


def _annotated(function: ast.AST) -> dict[str, str]:
    """Parameters of ``function`` annotated with one of the state classes."""
    out: dict[str, str] = {}
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for arg in [*function.args.args, *function.args.kwonlyargs]:
            if arg.annotation is not None:
                text = ast.unparse(arg.annotation).strip("'\"")
                for kind in CLASSES:
                    if text in (kind, f"Optional[{kind}]"):
                        out[arg.arg] = kind
    return out


def holder(receiver: ast.expr, annotated: dict[str, str], own_class: Optional[str]) -> Optional[str]:
    """The state class ``receiver`` holds, or None: ``self`` inside the class itself, a name the
    code gives that state (or annotated with its class), ``states[i]`` / ``….states[i]``, a unit's
    ``grads[i]``, and ``….step``."""
    if isinstance(receiver, ast.Name):
        if receiver.id == "self":
            return own_class
        if receiver.id in annotated:
            return annotated[receiver.id]
        return next((kind for kind, names in HOLDERS.items() if receiver.id in names), None)
    if isinstance(receiver, ast.Subscript):
        seq = ast.unparse(receiver.value)
        if seq == "states" or seq.endswith(".states"):
            return "UnitState"
        if seq.endswith(".grads"):
            return "GradientRecord"
    if isinstance(receiver, ast.Attribute) and receiver.attr == "step":
        return "StepState"
    return None


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    flat: list[ast.expr] = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets.extend(t.elts)
        else:
            flat.append(t)
    return flat


def writes_in(source: str) -> list[tuple[str, str, int]]:
    """(class, field, line) of every write to a state field in ``source``."""
    out = []
    tree = ast.parse(source)

    def visit(node: ast.AST, annotated: dict[str, str], own_class: Optional[str]) -> None:
        if isinstance(node, ast.ClassDef):
            own_class = node.name if node.name in CLASSES else None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotated = {**annotated, **_annotated(node)}
        for target in _targets(node):
            if isinstance(target, ast.Attribute):
                kind = holder(target.value, annotated, own_class)
                if kind is not None and target.attr in fields(kind):
                    out.append((kind, target.attr, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, annotated, own_class)

    visit(tree, {}, None)
    return out


def writers() -> dict[tuple[str, str], dict[str, list[int]]]:
    """(class, field) -> module -> lines assigning it, over the whole package."""
    found: dict[tuple[str, str], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for kind, name, line in writes_in(path.read_text()):
            found[(kind, name)][module].append(line)
    return found


def test_every_state_field_is_written_from_one_module():
    shared = {
        f"{kind}.{name}": {module: lines for module, lines in modules.items()}
        for (kind, name), modules in sorted(writers().items()) if len(modules) > 1
    }
    assert not shared, (
        "these fields are assigned from more than one module; give each one owner, with named transitions "
        f"the other modules call: {shared}"
    )


def test_the_owners_are_those_the_architecture_names():
    owner = {f"{kind}.{name}": sorted(modules) for (kind, name), modules in writers().items()}
    expected = {
        "UnitState.device_slot": ["runtime.params.cache"], "UnitState.fetch": ["runtime.params.cache"],
        "UnitState.host_copy": ["runtime.params.cache"], "UnitState.host_copy_read": ["runtime.params.cache"], "UnitState.home_read": ["runtime.params.cache"],
        "UnitState.pins": ["runtime.params.cache"], "UnitState.bound": ["runtime.params.cache"],
        "UnitState.bound_to": ["runtime.params.cache"], "UnitState.bound_versions": ["runtime.params.cache"],
        "UnitState.written": ["runtime.params.cache"], "UnitState.handed_out": ["runtime.params.cache"],
        "UnitState.placeholders": ["runtime.params.cache"],
        "UnitState.grads": ["runtime.grads.path"], "UnitState.grads_arrived": ["runtime.grads.path"],
        "UnitState.updated": ["runtime.updates.updater"], "UnitState.recompute_pinned": ["runtime.params.recompute"],
    }
    assert {k: owner.get(k) for k in expected} == expected


def test_the_scan_sees_writes_through_every_kind_of_holder():
    source = (
        "class UnitState:\n"
        "    def wait(self):\n"
        "        self.pins = 0\n"
        "def f(x: UnitState, states, ctx, record):\n"
        "    x.bound = True\n"
        "    states[3].pins += 1\n"
        "    ctx.states[2].updated, other.updated = False, False\n"
        "    x.grads[0].fresh = True\n"
        "    record.spilled = False\n"
        "    ctx.step.active = True\n"
        "    copy.written = True\n"  # not a unit's state
        "    x.not_a_field = 1\n"
    )
    assert sorted(writes_in(source)) == sorted([
        ("UnitState", "pins", 3), ("UnitState", "bound", 5), ("UnitState", "pins", 6), ("UnitState", "updated", 7),
        ("GradientRecord", "fresh", 8), ("GradientRecord", "spilled", 9), ("StepState", "active", 10),
    ])
