"""Misspelt strategy names answered with the nearest ``tiered*`` name and the list of them.

Lightning checks ``Trainer(strategy=...)`` (and Fabric its own) with ``name in registry.available_strategies()``
and, on a miss, raises a generic error whose examples name none of ours. That membership test is the only
place the name is seen before the error, so ``available_strategies`` of each registry is wrapped (an
attribute of the registry object, nothing private replaced) to return a list whose ``in`` raises our error
for a name that looks like one of ours (``"tierd"``, ``"tiered_zero-offload"``). Any other unknown name
gets ``False`` and Lightning's own message, and registered names behave as before.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable

FAMILY = "tiered"
# difflib's ratio above which a name is taken for a misspelling of one of ours; "tierd" -> "tiered" is 0.91,
# "ddp_spawn" -> "tiered_ddp" 0.42
_CLOSE = 0.75


class UnknownStrategyNameError(ValueError):
    """A strategy name close to one of the ``tiered*`` names but not one."""


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(" ", "_")


def suggestion(name: str, known: list[str]) -> str | None:
    """The registered ``tiered*`` name ``name`` most likely meant, or ``None`` if it looks like none of them."""
    ours = [k for k in known if k.startswith(FAMILY)]
    wanted = _normalized(name)
    if wanted in ours:
        return wanted
    close = difflib.get_close_matches(wanted, ours, n=1, cutoff=_CLOSE)
    if close:
        return close[0]
    if wanted.startswith(("tier", "teir")):  # a family member with an unknown preset: point at the base name
        return FAMILY
    return None


def unknown_name_message(name: str, meant: str, known: list[str]) -> str:
    ours = sorted(k for k in known if k.startswith(FAMILY))
    return (
        f"strategy={name!r} is not a registered strategy name; did you mean {meant!r}? "
        f"The tiered names are: {', '.join(ours)}."
    )


class _SuggestingNames(list[Any]):
    """The registry's names; ``in`` raises for a near miss of a ``tiered*`` name."""

    def __contains__(self, name: object) -> bool:
        if super().__contains__(name):
            return True
        if isinstance(name, str):
            meant = suggestion(name, list(self))
            if meant is not None:
                raise UnknownStrategyNameError(unknown_name_message(name, meant, list(self)))
        return False


class _SuggestingLister:
    """Stands for a registry's bound ``available_strategies``; marked so that wrapping is done once."""

    def __init__(self, original: Callable[[], list[Any]]) -> None:
        self.original = original

    def __call__(self) -> list[Any]:
        return _SuggestingNames(self.original())


def install(registry: Any) -> None:
    """Makes ``registry.available_strategies()`` answer near misses of our names (idempotent)."""
    current = registry.available_strategies
    if not isinstance(current, _SuggestingLister):
        registry.available_strategies = _SuggestingLister(current)
