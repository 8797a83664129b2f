"""Each tier's budget, granted once against what is free (``resolve_budgets``), and the refusal
that says the disk is full where the NVMe budget is what the disk has free (``refuse_a_full_disk``).

Torch and the hardware probes, no Lightning: the strategies' core calls these with its options."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

from ..config import Budget, format_bytes
from ..hardware import cuda_gpu_margin, disk_free, gpu_free, host_available
from ..planning.placement import PlacementError
from ..planning.planner import TierBudgets

Requested = tuple[Budget, Budget, Budget]  # gpu_memory, host_memory, nvme_memory


class MemoryBudgetError(ValueError):
    """A tier budget asks for more than the tier has free."""



def nvme_reserve(free: int) -> int:
    """Disk space an NVMe budget of "all that is free" (or a fraction of it) leaves unused."""
    # a file system spends a few blocks per file beyond its bytes: 1 MiB, or 0.1% of a large disk,
    # never more than an eighth of a small one
    return min(free // 8, max(1024**2, free // 1000))



def _share_emulated(gpu: Budget, host: Budget, available: int) -> tuple[int, int]:
    """The emulated GPU tier's budget and host memory's, from the same ``available`` host memory:
    two bounded budgets (bytes or fractions) must fit in it together; one left None takes what
    the other leaves; both None, each may use all of it (one pool: the planner fills the GPU tier
    first and host memory holds what does not fit there)."""
    gpu_bytes, host_bytes = gpu.resolve(available), host.resolve(available)
    bounded_gpu, bounded_host = gpu.bytes is not None or gpu.fraction is not None, host.bytes is not None or host.fraction is not None
    if bounded_gpu and bounded_host and gpu_bytes + host_bytes > available:
        raise MemoryBudgetError(
            f"gpu_memory={gpu} ({format_bytes(gpu_bytes)}) and host_memory={host} ({format_bytes(host_bytes)}) ask for "
            f"{format_bytes(gpu_bytes + host_bytes)} together, but there is no GPU: the GPU tier is emulated in the same host memory, "
            f"of which {format_bytes(available)} is available. Lower them so that together they are at most {format_bytes(available)} "
            f"(host_memory={format_bytes(max(available - gpu_bytes, 0))} beside this gpu_memory), or leave host_memory None to take "
            f"what gpu_memory leaves."
        )
    if bounded_gpu and not bounded_host:
        host_bytes = max(available - gpu_bytes, 0)
    elif bounded_host and not bounded_gpu:
        gpu_bytes = max(available - host_bytes, 0)
    return gpu_bytes, host_bytes


def resolve_budgets(
    requested: Requested, nvme_path: Optional[Path], root: torch.device, share: Callable[[TierBudgets, Requested], TierBudgets],
) -> TierBudgets:
    """Grant each tier its budget, refusing up front any that asks for more than is free. On a
    machine without a GPU the emulated GPU tier lives in host memory: the two are checked
    together against the same memory (``_share_emulated``). ``share``: each process's budgets
    from what the tiers have free (data parallelism's ``Ranks.share_budgets``)."""
    names = ("gpu_memory", "host_memory", "nvme_memory")
    free = {
        "gpu_memory": gpu_free(root),
        "host_memory": host_available(),
        "nvme_memory": disk_free(str(nvme_path)) if nvme_path else 0,
    }
    where = {
        "gpu_memory": f"{root} ({cuda_gpu_margin(root).describe()})" if root.type == "cuda" else "the emulated GPU tier (host memory)",
        "host_memory": "host memory",
        "nvme_memory": str(nvme_path),
    }
    granted = {}
    for name, budget in zip(names, requested):
        granted[name] = budget.resolve(free[name])
        if name == "nvme_memory" and budget.bytes is None:
            # measured once here for every NVMe store of the run; the reserve covers what the
            # file system spends beyond the bytes written (blocks, metadata, lock files)
            granted[name] = max(budget.resolve(free[name] - nvme_reserve(free[name])), 0)
        if budget.bytes is not None and budget.bytes > free[name]:
            raise MemoryBudgetError(
                f"{name}={format_bytes(budget.bytes)} asks for more than is free in {where[name]}: "
                f"{format_bytes(free[name])} free. Lower {name}, give a fraction such as 0.9, "
                f"or leave it None to use all that is free."
            )
    if root.type != "cuda":
        granted["gpu_memory"], granted["host_memory"] = _share_emulated(requested[0], requested[1], free["host_memory"])
    return share(TierBudgets(gpu=granted["gpu_memory"], host=granted["host_memory"], nvme=granted["nvme_memory"]), requested)


def gpu_after_profiling(gpu: int, kept: int, measured: int, where: str) -> tuple[int, str]:
    """A GPU tier of "all that is free" once the profiled steps measured what the caching allocator
    reserved beyond its allocations (``measured``): the margin kept at set-up for what lives
    outside the plan (``kept``: on CUDA a share of the GPU, for NCCL's buffers, fragmentation and
    workspaces) stays where it holds that, else the tier gives up the difference. The tier's bytes,
    and the budget line that says why."""
    short = max(measured - kept, 0)
    granted = max(gpu - short, 0)
    if short:
        reason = (f"the caching allocator reserved {format_bytes(measured)} beyond its allocations over the profiled steps, "
                  f"{format_bytes(short)} more than the {format_bytes(kept)} kept at set-up: the tier gives it up")
    else:
        reason = (f"the caching allocator reserved {format_bytes(measured)} beyond its allocations over the profiled steps, "
                  f"within the {format_bytes(kept)} kept at set-up")
    return granted, f"tiered: GPU tier {format_bytes(granted)} of {where}, all that is free less a margin of {format_bytes(max(kept, measured))}: {reason}"


def refuse_a_full_disk(error: PlacementError, nvme_path: Optional[Path], nvme_memory: Budget, budgets: Optional[TierBudgets]) -> None:
    """NVMe fell short where its budget is what the disk has free: say the disk is full."""
    if not error.nvme_needed or nvme_path is None or nvme_memory.bytes is not None:
        return
    if budgets is not None and budgets.nvme >= error.nvme_needed:
        return
    free = disk_free(str(nvme_path))
    raise PlacementError(
        f"{format_bytes(error.nvme_needed)} of parameters and optimizer states must go to NVMe, but the file system "
        f"under nvme_path={str(nvme_path)!r} has only {format_bytes(free)} free (nvme_memory="
        f"{'None' if nvme_memory.fraction is None else nvme_memory.fraction} grants what is free, less a reserve "
        f"of {format_bytes(nvme_reserve(free))}): free space there, point nvme_path at a larger disk, or raise host_memory.",
        nvme_needed=error.nvme_needed,
    ) from None
