"""Direct host access: a CUDA tensor over pinned host memory, so the GPU computes on a unit at
home without copying it in (MemFerry §III-B, the DHA and DFGB modes).

Under unified virtual addressing a pinned host pointer is valid on the GPU; an object that exposes
``__cuda_array_interface__`` over it, given to ``torch.as_tensor(..., device="cuda:N")``, becomes a
CUDA tensor whose reads and writes cross PCIe. The view owns nothing: the pinned tensor must outlive
it, and work that reads the view must be fenced (events) before the host memory is reused.

On the emulated GPU tier the device is the host, so the view is the host tensor itself.
"""

from __future__ import annotations

from typing import Any

import torch

# __cuda_array_interface__ type strings; bf16 has none, so it travels as int16 and is reinterpreted
_TYPESTR = {
    torch.float32: "<f4", torch.float16: "<f2", torch.float64: "<f8", torch.int64: "<i8", torch.int32: "<i4",
    torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1", torch.bool: "|b1",
}
_CARRIED_AS = {torch.bfloat16: torch.int16}


class _HostArray:
    """What ``torch.as_tensor`` reads a device array from: a pointer, a shape and a type."""

    def __init__(self, pointer: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {"shape": shape, "typestr": typestr, "data": (pointer, False), "version": 3, "strides": None}


def can_view(host: torch.Tensor, device: torch.device) -> bool:
    """Whether :func:`device_view` takes ``host`` for ``device`` (anything, off a GPU)."""
    if torch.device(device).type != "cuda":
        return True
    return host.device.type == "cpu" and host.is_pinned() and host.is_contiguous() and _CARRIED_AS.get(host.dtype, host.dtype) in _TYPESTR


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` over ``host``'s memory, without a copy (see the module docstring)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host
    if host.device.type != "cpu" or not host.is_pinned():
        raise ValueError(
            f"a direct-host-access view needs a pinned host tensor, got one on {host.device} "
            f"({'pinned' if host.device.type == 'cpu' and host.is_pinned() else 'not pinned'}); view a slot of the pinned host slab."
        )
    if not host.is_contiguous():
        raise ValueError(f"a direct-host-access view needs a contiguous host tensor (shape {tuple(host.shape)}, strides {host.stride()}).")
    carried = _CARRIED_AS.get(host.dtype, host.dtype)
    if carried not in _TYPESTR:
        raise ValueError(f"no direct-host-access view for dtype {host.dtype}; use one of {sorted(str(d) for d in (*_TYPESTR, *_CARRIED_AS))}.")
    view = torch.as_tensor(_HostArray(host.data_ptr(), tuple(host.shape), _TYPESTR[carried]), device=device)
    return view.view(host.dtype) if carried is not host.dtype else view
