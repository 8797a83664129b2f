"""Transfer units: the groups of parameters that move between tiers together.

By default each module that owns parameters directly is one unit. A parameter registered in
several modules (tied embeddings) belongs to exactly one unit, the first that registers it, and
every module that registers it *uses* that unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

# Each parameter starts at a multiple of this many bytes inside its unit's buffer, so that typed
# views of every dtype are aligned.
PARAM_ALIGNMENT = 64


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(eq=False)
class TransferUnit:
    """Parameters that are fetched, evicted and updated together."""

    index: int
    name: str
    params: list[nn.Parameter]
    param_names: list[str]
    offsets: list[int] = field(default_factory=list)  # byte offset of each parameter in the unit buffer
    nbytes: int = 0

    def __post_init__(self) -> None:
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset = _align(offset + p.numel() * p.element_size(), PARAM_ALIGNMENT)
        self.nbytes = offset

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params if p.requires_grad]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of each parameter inside ``buffer`` (a uint8 tensor of >= nbytes)."""
        out = []
        for p, offset in zip(self.params, self.offsets):
            size = p.numel() * p.element_size()
            out.append(buffer[offset : offset + size].view(p.dtype).view(p.shape))
        return out

    def layout_nbytes(self, dtypes: list[torch.dtype]) -> int:
        """Bytes of a buffer holding each parameter as ``dtypes`` (fp32 masters of bf16 parameters)."""
        offset = 0
        for p, dtype in zip(self.params, dtypes):
            offset = _align(offset + p.numel() * _element_size(dtype), PARAM_ALIGNMENT)
        return offset

    def typed_views(self, buffer: torch.Tensor, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        """Views of each parameter's shape in ``dtypes`` inside ``buffer`` (>= ``layout_nbytes``)."""
        out, offset = [], 0
        for p, dtype in zip(self.params, dtypes):
            size = p.numel() * _element_size(dtype)
            out.append(buffer[offset : offset + size].view(dtype).view(p.shape))
            offset = _align(offset + size, PARAM_ALIGNMENT)
        return out


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# Parameters computed in these dtypes get fp32 masters when the precision asks for them.
LOW_PRECISION = (torch.bfloat16, torch.float16)


def master_dtype(p: torch.Tensor, widen: bool) -> torch.dtype:
    """The dtype a parameter is updated in: fp32 for a trainable low-precision parameter when
    ``widen`` (``*-true`` precisions: the compute copy stays low precision), else its own."""
    return torch.float32 if widen and p.requires_grad and p.dtype in LOW_PRECISION else p.dtype


def build_units(model: nn.Module) -> tuple[list[TransferUnit], dict[nn.Module, list[TransferUnit]]]:
    """Units in registration order, and for every module the units it uses."""
    units: list[TransferUnit] = []
    owner: dict[int, TransferUnit] = {}
    users: dict[nn.Module, list[TransferUnit]] = {}
    for module_name, module in model.named_modules():
        used: list[TransferUnit] = []
        fresh_params, fresh_names = [], []
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in owner:
                if owner[id(param)] not in used:
                    used.append(owner[id(param)])
                continue
            fresh_params.append(param)
            fresh_names.append(f"{module_name}.{param_name}" if module_name else param_name)
        if fresh_params:
            unit = TransferUnit(index=len(units), name=module_name or "<root>", params=fresh_params, param_names=fresh_names)
            units.append(unit)
            for p in fresh_params:
                owner[id(p)] = unit
            used.insert(0, unit)
        if used:
            users[module] = used
    return units, users


def merge_into_chunks(
    units: list[TransferUnit], users: dict[nn.Module, list[TransferUnit]], chunk_bytes: int
) -> tuple[list[TransferUnit], dict[nn.Module, list[TransferUnit]]]:
    """Merge consecutive units into chunks of up to ``chunk_bytes`` (ProTrain §3.1.1).

    Fewer, larger transfers use the link better; a unit larger than ``chunk_bytes`` stays alone.
    Every module then uses the chunks that hold its units.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be positive.")
    groups: list[list[TransferUnit]] = []
    size = 0
    for unit in units:
        if groups and size + unit.nbytes <= chunk_bytes:
            groups[-1].append(unit)
            size += unit.nbytes
        else:
            groups.append([unit])
            size = unit.nbytes
    chunks: list[TransferUnit] = []
    chunk_of: dict[int, TransferUnit] = {}
    for members in groups:
        name = members[0].name if len(members) == 1 else f"{members[0].name} .. {members[-1].name}"
        chunk = TransferUnit(
            index=len(chunks),
            name=name,
            params=[p for u in members for p in u.params],
            param_names=[n for u in members for n in u.param_names],
        )
        chunks.append(chunk)
        for u in members:
            chunk_of[u.index] = chunk
    merged_users: dict[nn.Module, list[TransferUnit]] = {}
    for module, used in users.items():
        merged: list[TransferUnit] = []
        for u in used:
            if chunk_of[u.index] not in merged:
                merged.append(chunk_of[u.index])
        merged_users[module] = merged
    return chunks, merged_users
