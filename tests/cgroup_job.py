"""One process of ``test_budgets.py``'s real-cgroup test, run inside a memory cgroup: prints, as
JSON, the limit the strategy read, what ``host_memory=None`` was granted, and whether a
``host_memory`` above the group's limit was refused; then trains the tiny model with every unit
in host memory and ``host_memory=None`` and prints its losses.

    python tests/cgroup_job.py WORKDIR LIMIT_BYTES
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload_strategy import TieredStrategy  # noqa: E402
from offload_strategy.hardware import host_available  # noqa: E402
from offload_strategy.hardware.cgroup import cgroup_memory  # noqa: E402
from offload_strategy import MemoryBudgetError  # noqa: E402
from tests.helpers import train  # noqa: E402


def main() -> None:
    workdir, limit = Path(sys.argv[1]), int(sys.argv[2])
    group = cgroup_memory()
    out: dict = {"limit": group.limit if group else None, "available": host_available()}
    try:
        train(TieredStrategy(policy={"placement": "host"}, gpu_memory="1MiB", host_memory=limit + 2**20), workdir / "over", epochs=1)
        out["over_limit"] = "accepted"
    except MemoryBudgetError as error:
        out["over_limit"] = str(error)
    strategy = TieredStrategy(policy={"placement": "host"}, gpu_memory="1MiB")
    losses, _, _ = train(strategy, workdir / "fits", epochs=1)
    out["granted"] = strategy.budgets.host
    out["losses"] = losses
    print(json.dumps(out))


if __name__ == "__main__":
    main()
