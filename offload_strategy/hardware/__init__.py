"""Machines: known specs, probing of this one, and free memory per tier."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

from ..config import HardwareSpec
from .probe import (
    AVAILABLE_SHARE, cpu_cores, cublas_workspace_bytes, cuda_gpu_margin, disk_free, gpu_free, host_available, probe_hardware, process_peak_rss,
    FreedHostMemory, release_freed_host_memory, resident_anonymous,
)
from .specs import KNOWN_MACHINES, known_hardware


def resolve_hardware(value: Union[str, HardwareSpec, Mapping[str, Any]]) -> HardwareSpec:
    """``"auto"`` probes this machine, a known name gives its spec, a mapping gives its fields."""
    if isinstance(value, HardwareSpec):
        return value
    if isinstance(value, str):
        return probe_hardware() if value == "auto" else known_hardware(value)
    if isinstance(value, Mapping):
        fields = dict(value)
        fields.pop("_target_", None)
        try:
            return HardwareSpec(**fields)
        except TypeError as err:
            raise ValueError(f"hardware={value!r} does not describe a HardwareSpec: {err}.") from None
    raise ValueError(f"hardware={value!r} is not 'auto', a known machine name, a HardwareSpec or a mapping of its fields.")


__all__ = [
    "AVAILABLE_SHARE",
    "KNOWN_MACHINES",
    "HardwareSpec",
    "cpu_cores",
    "cublas_workspace_bytes",
    "disk_free",
    "cuda_gpu_margin",
    "gpu_free",
    "host_available",
    "release_freed_host_memory",
    "resident_anonymous",
    "FreedHostMemory",
    "known_hardware",
    "probe_hardware",
    "process_peak_rss",
    "resolve_hardware",
]
