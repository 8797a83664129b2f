"""The pinned slab's pages come from the GPU's NUMA node. Before, whichever intra-op thread
faulted a page in placed it on its own node, so on a two-socket machine the slab spread over both
sockets and half of every copy crossed the link between them. Now the mapping prefers the GPU's
node (mbind, MPOL_PREFERRED) before its first touch. Here the node is given explicitly (node 0
exists on every Linux machine) and the kernel's own account, /proc/self/numa_maps, is read."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from offload_strategy.hardware import numa
from offload_strategy.hardware.device import EmulatedDevice, make_device
from offload_strategy.memory import HostSlab

NUMA_MAPS = Path("/proc/self/numa_maps")
needs_numa_maps = pytest.mark.skipif(not sys.platform.startswith("linux") or not NUMA_MAPS.exists(), reason="/proc/self/numa_maps is Linux's, with NUMA")


def _policy(address: int) -> str:
    """The memory policy of the mapping that starts at ``address`` (its numa_maps line's second field)."""
    for line in NUMA_MAPS.read_text().splitlines():
        fields = line.split()
        if int(fields[0], 16) == address:
            return fields[1]
    raise AssertionError(f"no mapping starts at {address:#x} in {NUMA_MAPS}")


def _pages_on(address: int, node: int) -> int:
    for line in NUMA_MAPS.read_text().splitlines():
        fields = line.split()
        if int(fields[0], 16) == address:
            return sum(int(f.split("=")[1]) for f in fields if f.startswith(f"N{node}="))
    raise AssertionError(f"no mapping starts at {address:#x}")


def _bound_or_skip(slab: HostSlab) -> None:
    """Some containers' seccomp filters refuse mbind: then the slab kept the default policy, silently."""
    if slab.bound_node is None:
        assert _policy(slab.tensor.data_ptr()) == "default"
        pytest.skip("mbind is refused on this machine")


@needs_numa_maps
def test_the_slab_prefers_the_node_it_is_given_before_its_pages_are_touched():
    with HostSlab(4 << 20, pin=False, numa_node=0) as slab:
        _bound_or_skip(slab)
        address = slab.tensor.data_ptr()
        assert slab.bound_node == 0 and _policy(address) == "prefer:0"
        assert _pages_on(address, 0) > 0  # faulted in at creation, on that node


@needs_numa_maps
@pytest.mark.parametrize("node", [None, -1])
def test_no_node_leaves_the_default_policy(node):
    with HostSlab(4 << 20, pin=False, numa_node=node) as slab:
        assert slab.bound_node is None and _policy(slab.tensor.data_ptr()) == "default"


@needs_numa_maps
def test_a_refused_binding_falls_back_with_one_debug_line(caplog):
    """A node the machine lacks: the kernel refuses (EINVAL), and the slab is made as before."""
    missing = 1000
    assert not Path(f"/sys/devices/system/node/node{missing}").exists()
    with caplog.at_level(logging.DEBUG, logger=numa.__name__):
        with HostSlab(1 << 20, pin=False, numa_node=missing) as slab:
            assert slab.bound_node is None and _policy(slab.tensor.data_ptr()) == "default"
            assert int(slab.tensor.sum()) == 0  # made and faulted in all the same
    assert len([r for r in caplog.records if r.name == numa.__name__]) == 1
    assert "node 1000 failed" in caplog.records[-1].getMessage()


def test_no_system_call_number_falls_back_with_one_debug_line(monkeypatch, caplog):
    monkeypatch.setattr(numa.platform, "machine", lambda: "sparc64")
    with caplog.at_level(logging.DEBUG, logger=numa.__name__):
        with HostSlab(1 << 20, pin=False, numa_node=0) as slab:
            assert slab.bound_node is None
    assert [r.name for r in caplog.records] == [numa.__name__] and "sparc64" in caplog.records[0].getMessage()


@pytest.mark.parametrize("node", [-2, True, "0", 1.0])
def test_a_node_that_is_no_node_is_refused(node):
    with pytest.raises(ValueError, match="numa_node"):
        HostSlab(1 << 20, pin=False, numa_node=node)


def test_the_gpus_node_read_from_its_pci_address(tmp_path):
    address = numa.pci_address(SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0))
    assert address == "0000:3b:00.0"
    entry = tmp_path / "bus" / "pci" / "devices" / address
    entry.mkdir(parents=True)
    (entry / "numa_node").write_text("1\n")
    assert numa.pci_numa_node(address, sysfs=tmp_path) == 1
    (entry / "numa_node").write_text("-1\n")  # one node, or no affinity reported
    assert numa.pci_numa_node(address, sysfs=tmp_path) is None
    assert numa.pci_numa_node("0000:dc:00.0", sysfs=tmp_path) is None  # no such device
    assert numa.pci_numa_node(None, sysfs=tmp_path) is None
    assert numa.pci_address(SimpleNamespace(name="a torch without PCI ids")) is None


@needs_numa_maps
def test_the_engines_slab_takes_its_devices_node():
    """Through the device abstraction: the slab of host homes prefers the node the device names
    (a CUDA device reads it from sysfs; the emulated one is given it here)."""
    from offload_strategy.planning.placement import HOST, UnitSize, place_units
    from offload_strategy.runtime.engine import TieredEngine
    from offload_strategy.runtime.units import build_units

    for node, policy in ((0, "prefer:0"), (None, "default")):
        model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(6)))  # 4.1 KiB a unit
        units, users = build_units(model)
        sizes = [UnitSize(u.index, u.nbytes, u.nbytes) for u in units]
        placement = place_units(sizes, [[u.index for u in used] for used in users.values()], gpu_bytes=12000, host_bytes=2**20, nvme_bytes=0, state_factor=2)
        assert HOST in placement.home.values()
        device = make_device(torch.device("cpu"), capacity=12000)
        assert isinstance(device, EmulatedDevice)
        device.numa_node = node
        engine = TieredEngine(model, units, users, placement, device)
        try:
            slab = engine.memory.slab
            assert slab.nbytes > 0
            if node is not None:
                _bound_or_skip(slab)
            assert slab.bound_node == node and _policy(slab.tensor.data_ptr()) == policy
        finally:
            engine.close(materialize=True)
            device.close()


@pytest.mark.gpu
def test_a_pinned_slab_on_the_gpus_node():
    """On a GPU: the device finds its node, and a registered slab bound to it keeps its pages there."""
    device = make_device(torch.device("cuda"), 0)
    try:
        index = device.compute.index
        props = torch.cuda.get_device_properties(index)
        expected = numa.pci_numa_node(numa.pci_address(props))
        assert device.numa_node == expected
        print(f"cuda:{index} at {numa.pci_address(props)}: NUMA node {device.numa_node} (CPU nodes: {sorted(os.listdir('/sys/devices/system/node'))})")
        with HostSlab(64 << 20, pin=True, numa_node=device.numa_node) as slab:
            assert slab.pinned
            if device.numa_node is not None and NUMA_MAPS.exists():
                _bound_or_skip(slab)
                assert _policy(slab.tensor.data_ptr()) == f"prefer:{device.numa_node}"
                assert _pages_on(slab.tensor.data_ptr(), device.numa_node) > 0
    finally:
        device.close()


@needs_numa_maps
def test_the_gradient_slabs_beyond_the_plan_prefer_the_node_too():
    """The overflow's slabs (late-unfrozen homes, buffers beyond the pool) and accumulation's
    staging pieces carry gradients to the host as the tiers' slab does: the same node."""
    from offload_strategy.runtime.grads.overflow import GradientOverflow
    from offload_strategy.runtime.grads.staging import AccumulationStaging

    overflow = GradientOverflow(pin=False, numa_node=0)
    home = overflow.take(1 << 20, "a late-unfrozen home")  # no room set: no budget to check
    staging = AccumulationStaging(1 << 20, pin=False, numa_node=0)
    piece = staging.acquire()
    slabs = [*overflow._slabs.values(), staging._slab]
    for slab in slabs:
        _bound_or_skip(slab)
    assert [_policy(s.tensor.data_ptr()) for s in slabs] == ["prefer:0", "prefer:0"]
    assert home.data_ptr() == slabs[0].tensor.data_ptr() and piece.numel() == staging.piece_bytes
    staging.release(piece)
    staging.close()
    overflow.close()
