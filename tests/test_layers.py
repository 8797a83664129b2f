"""The package's layers, checked on its imports (every ``import`` in every module, at any depth).

From the bottom: ``config`` and the profile's data (``profiling/profile.py``); ``planning`` (pure
functions over sizes and times: no torch, no Lightning); ``hardware`` and ``memory``; ``runtime``
(the engine); ``profiling/analytic.py`` (shapes on the meta device, above the runtime's units),
``deferred`` and ``weights`` (models built without memory, weights read into homes), ``losses``
(a causal LM's loss a chunk at a time); ``session`` (the planning session: profile -> plan -> engine, torch
but no Lightning); and the Lightning glue on top (``strategy*``, ``callbacks``, ``checkpoint_io``, ``demos``, the package's
``__init__``), the only modules that may import Lightning. A module may import its own layer and
those below it. See docs/architecture.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "offload_strategy"

# layer of each module (dotted path below the package, by its longest matching prefix)
LAYERS = {
    "config": 0,
    "profiling.profile": 0,
    "profiling": 0,  # the package re-exports only the profile's data
    "planning": 1,
    "hardware": 2,
    "memory": 3,
    "memory.bandwidth": 3,  # measures the NVMe store against the raw disk (offload-strategy probe)
    "runtime": 4,
    "profiling.analytic": 5,
    "profiling.shapes": 5,
    "deferred": 5,
    "weights": 5,
    "losses": 5,
    "session": 6,
    "strategy": 7,
    "strategy_context": 7,
    "strategy_core": 7,
    "strategy_recipe": 7,
    "lightning": 7,
    "strategy_ddp": 7,
    "strategy_fabric": 7,
    "strategy_names": 7,
    "callbacks": 7,
    "checkpoint_io": 7,
    "sharded_checkpoint": 7,
    "__init__": 7,
    "estimate": 7,
    "estimate.budgets": 7,
    "estimate.models": 7,  # models built on the meta device from a config (Hydra's only with the experiments extra)
    "estimate.simulate": 7,
    "estimate.plans": 7,
    "checkpoint": 7,
    "checkpoint.consolidate": 7,
    "checkpoint.states": 7,  # checkpoints with true values and the units on NVMe after training: imports Lightning (rank_zero_info)
    "cli": 7,
    "__main__": 7,
    "demos": 7,  # the model, data and logger the tests, tools and experiments train with: a LightningModule
}
GLUE = 7
NO_TORCH = {"config", "profiling.profile", "profiling", "planning"}


def layer_of(module: str) -> tuple[str, int]:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return prefix, LAYERS[prefix]
    raise AssertionError(f"offload_strategy.{module} is in no layer: add it to LAYERS in tests/test_layers.py and docs/architecture.md")


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).with_suffix("")
        parts = list(relative.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def imports(module: str, path: Path) -> list[str]:
    """Every module ``module`` imports: package-internal as dotted paths below the package, others by top-level name."""
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    if module == "__init__":
        base = []
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                name = node.module or ""
                found += [name.removeprefix("offload_strategy.")] if name.startswith("offload_strategy") else [name]
                continue
            anchor = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            target = ".".join([*anchor, *(node.module.split(".") if node.module else [])])
            names = [f"{target}.{alias.name}" if target else alias.name for alias in node.names]
            found += ["@" + n for n in names]  # internal: resolved against LAYERS below
    return found


CASES = modules()


@pytest.mark.parametrize("module,path", CASES, ids=[m for m, _ in CASES])
def test_imports_only_its_own_layer_and_those_below(module, path):
    name, level = layer_of(module)
    for imported in imports(module, path):
        if imported.startswith("@"):
            target = imported[1:]
            try:
                _, target_level = layer_of(target)
            except AssertionError:  # a name imported from a package's __init__ (``from . import x``)
                _, target_level = layer_of(target.rsplit(".", 1)[0])
            assert target_level <= level, f"offload_strategy.{module} (layer {level}) imports {target} (layer {target_level})"
            continue
        top = imported.split(".")[0]
        if top == "lightning" or top == "pytorch_lightning":
            assert level == GLUE, f"offload_strategy.{module} imports {imported}: only the Lightning glue may"
        if name in NO_TORCH:
            assert top not in ("torch", "numpy", "lightning"), f"offload_strategy.{module} is pure planning data but imports {imported}"


def test_the_check_sees_a_violation(tmp_path):
    """The scan resolves relative imports: a planning module importing the runtime is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from ..runtime.engine import TieredEngine\nimport torch\n")
    found = imports("planning.bad", bad)
    assert "@runtime.engine.TieredEngine" in found and "torch" in found
    assert layer_of("runtime.engine")[1] > layer_of("planning.bad")[1]
