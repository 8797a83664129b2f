"""Plans on disk: what a run decided (every unit's home, every block's activation policy), written
so that it can be read, compared, edited and run again without planning.

A plan names each unit with its parameters' bytes, so a plan made for another model, or for the
same model with other dtypes, is refused with the first difference instead of running wrongly.

Besides the decisions a run follows (homes, block policies), a dumped plan explains itself: each
unit's compute mode, where its gradient is produced and where its optimizer states live, and the
step model's prediction for the plan. Those are for reading; a run derives them again from the
homes, so editing them changes nothing.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from ..config import BLOCK_POLICIES
from .placement import GPU, HOST, NVME

PLAN_VERSION = 1
HOMES = (GPU, HOST, NVME)
_FIX = ("dump a plan for this model and these budgets (strategy.dump_plan(path) after set-up, or `offload-strategy plan --out PATH`), "
        "or leave plan_file unset to plan anew")


@dataclass(frozen=True)
class PlannedUnit:
    name: str
    nbytes: int
    home: str
    # informative (see the module docstring); None where a plan does not say
    mode: Optional[str] = None  # resident, streamed (copied in for its compute), in_place (computed on host memory)
    gradient: Optional[str] = None  # gpu (stays), copied (GPU tier, then home), direct (written into host memory); none: frozen
    states: Optional[str] = None  # where its optimizer states live: gpu, host, nvme; none: frozen


EXPLAINED = ("mode", "gradient", "states")


@dataclass(frozen=True)
class PlanFile:
    units: tuple[PlannedUnit, ...]
    activations: Optional[tuple[str, ...]] = None  # one policy per block; None: the policy config's
    budgets: Optional[dict[str, int]] = None  # what the plan was made for (informative)
    prediction: Optional[dict[str, float]] = None  # the step model's breakdown in seconds, and bytes copied in (informative)

    def to_json(self) -> dict[str, Any]:
        units = []
        for u in self.units:
            entry: dict[str, Any] = {"name": u.name, "bytes": u.nbytes, "home": u.home}
            entry.update({key: getattr(u, key) for key in EXPLAINED if getattr(u, key) is not None})
            units.append(entry)
        return {
            "version": PLAN_VERSION,
            "units": units,
            "activations": list(self.activations) if self.activations is not None else None,
            "budgets": self.budgets,
            "prediction": self.prediction,
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "the plan") -> "PlanFile":
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{source} is not a version-{PLAN_VERSION} plan (found version {found!r}); {_FIX}.")
        try:
            units = tuple(
                PlannedUnit(str(u["name"]), int(u["bytes"]), str(u["home"]), *(str(u[k]) if u.get(k) is not None else None for k in EXPLAINED))
                for u in data["units"]
            )
        except (KeyError, TypeError, ValueError, OverflowError) as error:
            raise ValueError(f"{source} has a malformed unit entry ({error!r}); each needs name, bytes and home. {_FIX}.") from error
        bad = sorted({u.home for u in units} - set(HOMES))
        if bad:
            raise ValueError(f"{source} names homes {bad}; a home is one of {', '.join(HOMES)}.")
        if any(u.nbytes < 0 for u in units):
            raise ValueError(f"{source} gives a unit a negative size; {_FIX}.")
        activations = data.get("activations")
        if activations is not None and (not isinstance(activations, list) or not all(a in BLOCK_POLICIES for a in activations)):
            raise ValueError(
                f"{source} gives activations={activations!r}; it must be a list of block policies ({', '.join(BLOCK_POLICIES)}), one per block. {_FIX}."
            )
        for key in ("budgets", "prediction"):
            if data.get(key) is not None and not isinstance(data[key], dict):
                raise ValueError(f"{source} gives {key}={data[key]!r}; it must be an object. {_FIX}.")
        return cls(units, tuple(activations) if activations is not None else None, data.get("budgets"), data.get("prediction"))


def prediction_record(prediction: Any, layout_seconds: float = 0.0) -> dict[str, float]:
    """A plan file's ``prediction`` from the step model's ``StepPrediction`` (``layout_seconds``:
    what the blocks' activation layout adds to the parameters' step)."""
    record = {
        "step_seconds": prediction.seconds + layout_seconds, "forward_seconds": prediction.forward_seconds,
        "backward_seconds": prediction.backward_seconds, "update_tail_seconds": prediction.update_tail_seconds,
        "exposed_seconds": prediction.exposed_seconds, "h2d_bytes": float(prediction.h2d_bytes),
    }
    if layout_seconds:
        record["layout_seconds"] = layout_seconds
    return record


def save_plan(plan: PlanFile, path: Union[str, Path]) -> Path:
    """Write ``plan`` as JSON, atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(plan.to_json(), handle, indent=1)
            handle.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def load_plan(path: Union[str, Path]) -> PlanFile:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"plan_file={str(path)!r} is not JSON text ({error}); {_FIX}.") from error
    except OSError as error:
        raise ValueError(f"plan_file={str(path)!r} cannot be read: {error.strerror or error}; {_FIX}.") from error
    return PlanFile.from_json(data, source=f"plan_file={str(path)!r}")


def check_plan(plan: PlanFile, names: Sequence[str], nbytes: Sequence[int], blocks: int) -> None:
    """Refuse a plan made for another model: unit count, then each unit's name and bytes, then the block count."""
    if len(plan.units) != len(names):
        raise ValueError(f"the plan has {len(plan.units)} units but this model has {len(names)}; {_FIX}.")
    for index, (planned, name, size) in enumerate(zip(plan.units, names, nbytes)):
        if planned.name != name or planned.nbytes != size:
            raise ValueError(
                f"unit {index} of the plan is {planned.name!r} of {planned.nbytes:,} bytes but this model's is {name!r} of "
                f"{size:,} bytes; {_FIX}."
            )
    if plan.activations is not None and len(plan.activations) != blocks:
        raise ValueError(f"the plan gives {len(plan.activations)} block policies but this model has {blocks} blocks; {_FIX}.")
