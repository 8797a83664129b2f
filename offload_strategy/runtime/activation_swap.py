"""Swapping a block's saved activations out of the GPU tier and back ahead of its backward.

Inside a swap block's forward, saved-tensor hooks (ProTrain §3.1.2's activation swapping; the
offload side of LoHan §IV-B) hand every tensor autograd saves for backward to this class:

- a tensor that is, or views, a parameter stays where it is (the engine re-fetches parameters by
  itself; an activation swap must never copy a weight);
- a tensor smaller than ``MIN_SWAP_BYTES`` stays (the copy would cost more than it frees);
- any other tensor is copied to host memory asynchronously and the GPU-tier original is let go; a
  ``swap_nvme`` block's copies continue from host memory to the NVMe store, and their host buffers
  are let go once written. Host memory holds at most ``host_limit`` bytes of swapped activations
  per step: beyond it a ``swap_host`` tensor goes on to NVMe when there is a store, and otherwise
  stays in the GPU tier (counted in ``stats.host_full_bytes``).

Backward unpacks a block's tensors in reverse order. The first unpack of a block brings back all of
that block's tensors and starts bringing back the next swap block's (prefetch by block order), so
later unpacks find their tensors already in the GPU tier. Values are copied bit for bit: a swapped
run computes exactly what a kept run computes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..config import BlockPolicy
from ..hardware.device import Device, Event
from ..memory.nvme import NvmeSpaceError, NvmeStore

SWAP_HOST, SWAP_NVME = BlockPolicy.SWAP_HOST, BlockPolicy.SWAP_NVME
# Saved tensors below this size stay in the GPU tier.
MIN_SWAP_BYTES = 4096


@dataclass(eq=False)
class _Swapped:
    """One saved tensor that left the GPU tier."""

    block: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    host: Optional[torch.Tensor]  # its bytes in host memory (None once written to NVMe)
    to_host: Optional[Event]
    key: Optional[str] = None  # NVMe key
    written: Any = None  # Future of the NVMe write
    back: Optional[torch.Tensor] = None  # its copy in the GPU tier once brought back
    to_device: Optional[Event] = None
    used: bool = False  # unpacked by backward (a second backward through a kept graph fetches it again)


@dataclass
class SwapStats:
    """Bytes by destination in the last training forward, and how backward found them."""

    kept_bytes: int = 0
    host_bytes: int = 0
    nvme_bytes: int = 0
    prefetched: int = 0
    waited: int = 0  # unpacks that had to fetch synchronously
    wait_seconds: float = 0.0
    host_full_bytes: int = 0  # swap_host tensors kept in the GPU tier: host limit reached, no NVMe store
    blocks: dict[int, list[_Swapped]] = field(default_factory=dict)


class ActivationSwap:
    """Saved-tensor hooks for swap blocks; see the module docstring.

    ``is_parameter`` tells whether a saved tensor is or views a parameter; ``outer`` is the pair
    of hooks that would have packed it otherwise (the engine's), or None.
    """

    def __init__(self, device: Device, store: Optional[NvmeStore], is_parameter: Callable[[torch.Tensor], bool], host_limit: Optional[int] = None) -> None:
        self.device = device
        self.store = store
        self.host_limit = host_limit
        self.is_parameter = is_parameter
        self.outer: Optional[tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = None
        self.stats = SwapStats()
        self._keys = itertools.count()
        self._order: list[int] = []  # swap blocks in the order forward ran them

    def begin_forward(self) -> None:
        """A training forward starts: what the last step swapped is gone (its backward consumed it)."""
        for swapped in self.stats.blocks.values():
            for s in swapped:
                self._forget(s)
        self.stats = SwapStats()
        self._order = []

    def hooks(self, block: int, destination: str) -> torch.autograd.graph.saved_tensors_hooks:
        if block not in self.stats.blocks:
            self.stats.blocks[block] = []
            self._order.append(block)
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(block, destination, t), self._unpack)

    # -- forward ------------------------------------------------------------------------------------

    def _pack(self, block: int, destination: str, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if self.is_parameter(t):
            return ("outer", self.outer[0](t)) if self.outer else t
        requested = destination
        if destination == SWAP_HOST and self.host_limit is not None and self.stats.host_bytes + nbytes > self.host_limit:
            destination = SWAP_NVME if self.store is not None else ""
            if not destination:
                self.stats.host_full_bytes += nbytes
        if nbytes < MIN_SWAP_BYTES or t.layout != torch.strided or not destination:
            self.stats.kept_bytes += nbytes
            return ("outer", self.outer[0](t)) if self.outer else t
        pin = self.device.compute.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        swapped = _Swapped(block, tuple(t.shape), t.dtype, host, self.device.copy_to_host(host, t.detach().contiguous()))
        if destination == SWAP_NVME and self.store is not None:
            swapped.to_host.wait()
            swapped.to_host = None
            key = f"activation{next(self._keys)}"
            try:
                swapped.written = self.store.write(key, host)
            except NvmeSpaceError:
                if requested == SWAP_NVME:
                    raise
                self.stats.host_full_bytes += nbytes  # over host memory and the NVMe budget: it stays
                self.stats.kept_bytes += nbytes
                return ("outer", self.outer[0](t)) if self.outer else t
            swapped.key = key
            self.stats.nvme_bytes += nbytes
        else:
            self.stats.host_bytes += nbytes
        self.stats.blocks[block].append(swapped)
        return swapped

    # -- backward -----------------------------------------------------------------------------------

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple) and len(packed) == 2 and packed[0] == "outer":
            return self.outer[1](packed[1])
        if not isinstance(packed, _Swapped):
            return packed
        if packed.used:
            packed.used = False
            self._bring_back(packed.block)
        if packed.back is None:
            start = time.perf_counter()
            self._bring_back(packed.block)
            self.stats.waited += 1
            self._prefetch_below(packed.block)
            self.device.wait(packed.to_device)
            self.stats.wait_seconds += time.perf_counter() - start
        else:
            self.stats.prefetched += 1
            self.device.wait(packed.to_device)
        # autograd holds the tensor now; letting go of it here frees the GPU tier when it is done
        back, packed.back, packed.to_device = packed.back, None, None
        packed.used = True
        return back

    def _bring_back(self, block: int) -> None:
        for s in self.stats.blocks.get(block, []):
            if s.back is not None or s.used:
                continue
            if s.key is not None:  # from NVMe into host memory first
                s.written.result()
                s.host = torch.empty(s.shape, dtype=s.dtype, pin_memory=self.device.compute.type == "cuda")
                self.store.read(s.key, s.host).result()
                self.store.delete(s.key)
                s.key = None
            elif s.to_host is not None:
                s.to_host.wait()
            s.back = torch.empty(s.shape, dtype=s.dtype, device=self.device.compute)
            s.to_device = self.device.copy_to_device(s.back, s.host)

    def _prefetch_below(self, block: int) -> None:
        """Start bringing back the swap block that backward reaches next."""
        position = self._order.index(block) if block in self._order else -1
        if position > 0:
            self._bring_back(self._order[position - 1])

    def _forget(self, s: _Swapped) -> None:
        if s.key is not None and self.store is not None:
            if s.written is not None:
                s.written.exception()  # wait; a failed write is moot once the tensor is not needed
            self.store.delete(s.key)
            s.key = None
        s.host = s.back = None

    def close(self) -> None:
        self.begin_forward()
