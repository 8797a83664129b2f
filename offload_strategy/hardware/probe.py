"""What this machine has: sizes and free memory per tier, read from the OS and the CUDA driver.

Bandwidths and compute rates are measured by the profiler, not here; a probed spec borrows the
datasheet figures of the known machine whose GPU it recognises.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import resource
import shutil
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Optional

import psutil
import torch

from ..config import HardwareSpec, format_bytes
from .cgroup import cgroup_memory
from .specs import KNOWN_MACHINES

# GPU product-name fragments (as CUDA reports them) -> known spec to borrow peak figures from.
_GPU_FAMILIES = (
    ("H200", "h200"),
    ("H100", "h100_80g"),
    ("A100", "a100_80g"),
    ("4090", "rtx4090"),
    ("3090", "rtx3090"),
    ("L40S", "l40s"),
    ("V100", "v100_16g"),
)


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# What host_memory=None finds on a machine that is not at hand (a what-if, a plan made elsewhere):
# all that is available, on an idle machine its memory less what the OS and the training process
# hold. The development machine, idle, has 97.8% of its 24 GiB available; 95% leaves the process its own.
AVAILABLE_SHARE = 0.95


def host_available() -> int:
    """Bytes of host memory the OS can give without swapping, and within the limit of the control
    group the process runs in, where one is set (``cgroup.py``: a container's limit is where the
    OOM killer acts, however much the machine has free)."""
    available = int(psutil.virtual_memory().available)
    group = cgroup_memory()
    return available if group is None else min(available, group.free)


def host_total() -> int:
    """Bytes of host memory the process may hold at most: the machine's, or its control group's limit."""
    total = int(psutil.virtual_memory().total)
    group = cgroup_memory()
    return total if group is None else min(total, group.limit)


# Training multiplies matrices on two threads: the training loop's and autograd's backward thread.
_MATMUL_THREADS = 2
_KIB = 1024


def cublas_workspace_bytes(major: int, config: Optional[str] = None, lt_kib: Optional[str] = None) -> int:
    """GPU memory cuBLAS and cuBLASLt take per thread and stream that multiplies matrices, from
    PyTorch's caching allocator and outside every tier: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT``
    pairs, KiB) or PyTorch's default (32 MiB from compute capability 9, 8 MiB and 128 KiB before),
    and ``TORCH_CUBLASLT_WORKSPACE_SIZE`` (KiB, 1 MiB by default). Measured on an H200 with
    ``tools/cuda_reserve.py``: 32 MiB at the first product, 1 MiB at the first with a bias, 33 more
    for the backward thread and for a second stream."""
    if config:
        numbers = [int(n) for n in config.split(":") if n]
        cublas = sum(size * count for size, count in zip(numbers[::2], numbers[1::2])) * _KIB
    else:
        cublas = 4096 * 8 * _KIB if major >= 9 else (4096 * 2 + 16 * 8) * _KIB
    return cublas + int(lt_kib or 1024) * _KIB


def gpu_reserve(device: torch.device) -> int:
    """What a GPU tier of "all that is free" leaves to cuBLAS's workspaces (both training threads)."""
    major, _minor = torch.cuda.get_device_capability(device)
    workspace = cublas_workspace_bytes(major, os.environ.get("CUBLAS_WORKSPACE_CONFIG"), os.environ.get("TORCH_CUBLASLT_WORKSPACE_SIZE"))
    return _MATMUL_THREADS * workspace


# Of the GPU's memory, the share "all that is free" leaves beside the plan: NCCL's communicator
# buffers (made by the first collective, after the budget is read: hundreds of MB, more with NVLS),
# the caching allocator's fragmentation, SDPA's and cuDNN's workspaces. Not measured yet on a GPU.
GPU_MARGIN_SHARE = 0.05


@dataclasses.dataclass(frozen=True)
class GpuMargin:
    """What a GPU tier of "all that is free" (or a fraction of it) leaves outside the plan."""

    workspaces: int  # cuBLAS's, both training threads
    cached: int  # reserved by PyTorch's caching allocator and not allocated: free, but not to cudaMalloc
    share: int  # GPU_MARGIN_SHARE of the GPU's memory

    @property
    def nbytes(self) -> int:
        return self.workspaces + self.share

    def describe(self) -> str:
        return (f"less cuBLAS's workspaces ({format_bytes(self.workspaces)}) and {GPU_MARGIN_SHARE:.0%} of its memory "
                f"({format_bytes(self.share)}) for NCCL's buffers, the caching allocator's fragmentation and SDPA's and "
                f"cuDNN's workspaces")


def gpu_margin(total: int, workspaces: int, reserved: int, allocated: int) -> GpuMargin:
    """The margin for a GPU of ``total`` bytes whose caching allocator holds ``reserved`` bytes, of
    them ``allocated`` in use: what it reserved and does not use counts as free to this process."""
    return GpuMargin(workspaces=workspaces, cached=max(reserved - allocated, 0), share=int(total * GPU_MARGIN_SHARE))


def gpu_room(free: int, margin: GpuMargin) -> int:
    """What a GPU tier of "all that is free" may take: the driver's free bytes and the cache's
    unused ones, less the margin."""
    return max(free + margin.cached - margin.nbytes, 0)


def gpu_free(device: torch.device) -> int:
    """Bytes the GPU tier can have on a CUDA device: free memory less :func:`gpu_margin`; on other
    devices the GPU tier is emulated in host memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        margin = gpu_margin(int(total), gpu_reserve(device), torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))
        return gpu_room(int(free), margin)
    return host_available()


def cuda_gpu_margin(device: torch.device) -> GpuMargin:
    """The margin :func:`gpu_free` leaves on the CUDA ``device``."""
    _free, total = torch.cuda.mem_get_info(device)
    return gpu_margin(int(total), gpu_reserve(device), torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))


def process_peak_rss() -> int:
    """Peak resident set of this process in bytes (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def release_freed_host_memory() -> None:
    """Give the OS back the freed memory the C allocator keeps (glibc's ``malloc_trim``; nothing
    where there is none). glibc serves blocks under its mmap threshold, which it raises up to
    32 MiB as large blocks are freed, from heaps it returns only from their top: after training
    puts gigabytes through them (optimizer states moved between engines, units read back), they
    would keep those gigabytes resident though nothing uses them."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def resident_anonymous() -> int:
    """This process's anonymous resident set in bytes (heap, tensors, anonymous mappings; not the
    libraries' file pages nor shared memory): ``/proc/self/statm``'s resident less its shared
    pages, one read; 0 where there is no such file."""
    try:
        with open("/proc/self/statm") as statm:
            fields = statm.read().split()
    except OSError:
        return 0
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


# After giving freed memory back, how much more the resident set may grow before it is given
# back again: where what is live stands above the limit, a trim at every check would only cost.
# 4 MiB: at 16 the freed memory left between two trims added 0.03-0.05x of the bound to the
# 101M job's peak, for a quarter fewer trims (docs/benchmarks.md, "Optimizer states made in their buffer").
FREED_MEMORY_SLACK = 4 * 2**20


class FreedHostMemory:
    """Keeps the freed memory the C allocator holds from carrying the process past ``limit``
    (resident anonymous bytes; None: no limit). Tensors made and freed at every step on the CPU
    (autograd's gradients and activations on the emulated GPU tier, the optimizer's own
    temporaries) come from glibc's heaps once its mmap threshold has risen, and heaps fragmented
    by the small objects made between them keep gigabytes of freed blocks resident. ``check``, at
    points of the step that come often (each unit's gradients complete, each unit updated),
    reads the resident set and, above the limit, gives freed memory back (``malloc_trim``):
    nothing is paid while the process stays under it, unlike a fixed mmap threshold, which
    faults every large tensor's pages in afresh (docs/benchmarks.md, "Freed memory during the
    steps")."""

    def __init__(self, limit: Optional[int] = None) -> None:
        self.limit = limit
        self.trims = 0  # times freed memory was given back
        self._floor = 0  # after a trim: the resident set it left plus the slack
        self._busy = threading.Lock()
        self._statm: Optional[int] = None  # /proc/self/statm kept open: a check comes per gradient, per module

    def check(self) -> None:
        if self.limit is None or self._resident() <= max(self.limit, self._floor):
            return
        self.release()

    def release(self) -> None:
        """Give freed memory back now, whatever the resident set; checks after it trim again only
        past the limit and what this left plus the slack (where the steps left a floor above the
        limit, a phase that frees what they held starts from what it left)."""
        if not self._busy.acquire(blocking=False):
            return  # the other thread is giving it back now
        try:
            release_freed_host_memory()
            self.trims += 1
            self._floor = resident_anonymous() + FREED_MEMORY_SLACK
        finally:
            self._busy.release()

    def _resident(self) -> int:
        """``resident_anonymous()`` read through a descriptor kept open (1.6 µs a read, against
        14 µs opening the file each time)."""
        try:
            if self._statm is None:
                self._statm = os.open("/proc/self/statm", os.O_RDONLY)
                weakref.finalize(self, os.close, self._statm)
            fields = os.pread(self._statm, 128, 0).split()
        except OSError:
            return resident_anonymous()
        return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


def disk_free(path: Optional[str]) -> int:
    """Free bytes on the file system holding ``path`` (its nearest existing ancestor)."""
    if path is None:
        return 0
    probe = Path(path).expanduser().absolute()
    while not probe.exists():
        probe = probe.parent
    return int(shutil.disk_usage(probe).free)


def _borrowed_figures(gpu_name: str, gpu_memory: int) -> dict[str, Any]:
    for fragment, key in _GPU_FAMILIES:
        if fragment in gpu_name:
            if key == "a100_80g" and gpu_memory < 60 * 1024**3:
                key = "a100_40g"
            spec = KNOWN_MACHINES[key]
            return {
                "gpu_bf16_tflops": spec.gpu_bf16_tflops,
                "gpu_fp16_tflops": spec.gpu_fp16_tflops,
                "gpu_fp32_tflops": spec.gpu_fp32_tflops,
                "h2d_gbps": spec.h2d_gbps,
                "d2h_gbps": spec.d2h_gbps,
                "gpu_memory_gbps": spec.gpu_memory_gbps,
            }
    return {"gpu_bf16_tflops": None, "gpu_fp16_tflops": None, "gpu_fp32_tflops": None, "h2d_gbps": None, "d2h_gbps": None, "gpu_memory_gbps": None}


def probe_hardware(**overrides: Any) -> HardwareSpec:
    """Describe this machine. ``overrides`` replace probed fields (``gpu_memory="8GiB"``)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu, gpu_memory = props.name, int(props.total_memory)
        figures = _borrowed_figures(gpu, gpu_memory)
        source = f"probed; peak figures from the datasheet of the {gpu}" if figures["h2d_gbps"] else "probed"
    else:
        gpu, gpu_memory = "none (GPU tier emulated in host memory)", 0
        figures = _borrowed_figures("", 0)
        source = "probed"
    spec = HardwareSpec(
        name="auto",
        gpu=gpu,
        gpu_memory=gpu_memory,
        host_memory=host_total(),
        cpu_cores=cpu_cores(),
        source=source,
        **figures,
    )
    fields = {f.name for f in dataclasses.fields(spec)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"hardware overrides {unknown} are not fields of HardwareSpec; fields: {sorted(fields)}.")
    return dataclasses.replace(spec, **overrides) if overrides else spec
