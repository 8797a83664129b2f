"""A CUDA out-of-memory error inside a training step, told against the plan: what the plan holds
in the GPU tier, what PyTorch held when it failed, and what to change."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..config import format_bytes
from ..planning.activations import BesideBlocks


@dataclass(frozen=True)
class PlannedUse:
    """The GPU tier as planned when the step ran: ``activations`` is the layout's planned peak
    (with ``beside`` in it), None while the first steps measure them."""

    budget: int
    parameters: int
    activations: Optional[int] = None
    beside: BesideBlocks = BesideBlocks()


@dataclass(frozen=True)
class AllocatorUse:
    """``torch.cuda``'s own figures at the failure (the caching allocator's)."""

    allocated: int
    reserved: int
    peak: int


def out_of_memory_message(error: str, plan: PlannedUse, held: Optional[AllocatorUse]) -> str:
    """The explanation of ``error`` (PyTorch's message; its first sentence is kept)."""
    asked = error.split(". GPU")[0].strip().rstrip(".")
    planned = plan.parameters + (plan.activations or 0)
    if plan.activations is None:
        acts = "no plan of its activations (the first training steps still measuring them)"
    else:
        acts = f"{format_bytes(plan.activations)} of activations at their planned peak" + plan.beside.note(" (of it, ") + (")" if plan.beside.bytes else "")
    lines = [
        f"{asked} in a training step under strategy='tiered'.",
        f"The plan holds {format_bytes(plan.parameters)} for the parameters (their gradients, optimizer states and streaming buffers with them) and {acts} "
        f"in gpu_memory={format_bytes(plan.budget)}.",
    ]
    beyond = 0
    if held is not None:
        beyond = max(held.reserved - planned, 0)
        lines.append(
            f"PyTorch held {format_bytes(held.allocated)} allocated and {format_bytes(held.reserved)} reserved when it failed "
            f"(peak {format_bytes(held.peak)} allocated): {format_bytes(beyond)} reserved beyond the plan, outside every tier "
            f"(cuBLAS's workspaces, the allocator's rounding and its cached blocks, tensors the training step keeps that the first steps did not measure)."
        )
    if beyond and beyond < plan.budget:
        fix = f"Lower gpu_memory by that, to {format_bytes(plan.budget - beyond)}"
    else:
        fix = "Lower gpu_memory (or the batch size)"
    lines.append(
        f"{fix}; where reserved is far above allocated, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets the allocator reuse its cached blocks."
    )
    return "\n".join(lines)


def allocator_use(device: torch.device) -> Optional[AllocatorUse]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return AllocatorUse(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), torch.cuda.max_memory_allocated(device))


@contextlib.contextmanager
def out_of_memory_explained(plan: Callable[[], Optional[PlannedUse]], device: torch.device) -> Iterator[None]:
    """Re-raise a CUDA out-of-memory error with :func:`out_of_memory_message` (once: an error told
    already passes through outer uses unchanged)."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        planned = plan()
        if getattr(error, "told", False) or planned is None:
            raise
        told = torch.OutOfMemoryError(out_of_memory_message(str(error), planned, allocator_use(device)))
        told.told = True  # type: ignore[attr-defined]
        raise told from error
