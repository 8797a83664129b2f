"""The NUMA node a GPU is attached to, and host memory bound to a node before its first touch.

On a two-socket machine each GPU's PCIe root port hangs off one socket. Host memory on the other
socket reaches the GPU over the link between the sockets, which is slower and which every GPU's
copies share. Without a policy, a page lands on the node of the thread that first touches it. The
pinned slab is faulted in by all of torch's intra-op threads, so its pages spread over both
nodes. ``mbind(2)`` with ``MPOL_PREFERRED``, called before the first touch, puts them on the GPU's
node. When that node is full the kernel takes pages from another node, so the call never makes an
allocation fail.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Any, Optional

import torch

MPOL_PREFERRED = 1  # include/uapi/linux/mempolicy.h
# mbind's system call number: the same on every libc, absent from Python's os module
MBIND_SYSCALL = {"x86_64": 237, "aarch64": 235}
SYSFS = Path("/sys")


def pci_address(properties: Any) -> Optional[str]:
    """The sysfs PCI address (``0000:3b:00.0``) of a GPU from ``torch.cuda.get_device_properties``,
    or None where that build of torch does not report the GPU's PCI ids."""
    try:
        domain, bus, device = int(properties.pci_domain_id), int(properties.pci_bus_id), int(properties.pci_device_id)
    except (AttributeError, TypeError, ValueError):
        return None
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def pci_numa_node(address: Optional[str], sysfs: Path = SYSFS) -> Optional[int]:
    """The NUMA node of the PCI device at ``address``. Returns None (no preference) when the
    address is unknown, sysfs has no entry for it, or the kernel reports -1 (one node, or no
    affinity)."""
    if address is None:
        return None
    try:
        node = int((sysfs / "bus" / "pci" / "devices" / address / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def gpu_numa_node(index: int, sysfs: Path = SYSFS) -> Optional[int]:
    """The NUMA node of CUDA device ``index``, found from its PCI address without nvidia-smi.
    Returns None where the node is unknown or there is only one."""
    return pci_numa_node(pci_address(torch.cuda.get_device_properties(index)), sysfs)


def prefer_node(address: int, nbytes: int, node: int) -> bool:
    """Set the memory policy of the pages in ``[address, address + nbytes)`` to prefer ``node``
    (``mbind`` with ``MPOL_PREFERRED``). Pages touched afterwards are placed there, and pages
    already faulted in stay where they are. Returns True once the policy is set. Where the
    system call is unavailable (not Linux, another architecture, a seccomp filter, a kernel
    without NUMA), returns False and logs one debug line: the pages then go where first touch
    puts them, as they would without this call."""
    if isinstance(node, bool) or not isinstance(node, int) or node < 0:
        raise ValueError(f"prefer_node: node={node!r} must be a NUMA node number >= 0 (None or -1 mean no preference: do not call).")
    if nbytes <= 0:
        return False
    number = MBIND_SYSCALL.get(platform.machine())
    if number is None or not sys.platform.startswith("linux"):
        logging.getLogger(__name__).debug("mbind: no system call number for %s on %s; host pages placed by first touch", platform.machine(), sys.platform)
        return False
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    words = node // bits + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // bits] = 1 << (node % bits)
    libc = ctypes.CDLL(None, use_errno=True)
    # maxnode counts one bit past the mask (the kernel reads maxnode - 1 bits)
    result = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(address), ctypes.c_ulong(nbytes), ctypes.c_int(MPOL_PREFERRED),
                          mask, ctypes.c_ulong(words * bits + 1), ctypes.c_uint(0))
    if result != 0:
        error = ctypes.get_errno()
        logging.getLogger(__name__).debug("mbind of %d bytes at %#x to node %d failed (%s); host pages placed by first touch",
                                          nbytes, address, node, os.strerror(error))
        return False
    return True
