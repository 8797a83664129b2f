"""The pinned slab is not inherited by processes forked after it (DataLoader workers): Linux would
copy its pinned pages into every child."""

from __future__ import annotations

import os
import sys

import pytest

from offload_strategy.memory import HostSlab

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTFORK and /proc are Linux's")


def _mapping_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    start, flags = None, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start = int(head.split("-")[0], 16)
            elif head == "VmFlags:" and start == address:
                flags = line.split()[1:]
    assert flags is not None, f"no mapping starts at {address:#x}"
    return flags


def _mapped_in_child(address: int) -> bool:
    """Whether a child forked now has a mapping holding ``address``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: look at its own mappings, answer, leave at once
        with open("/proc/self/maps") as maps:
            ranges = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps]
        os.write(write, b"1" if any(lo <= address < hi for lo, hi in ranges) else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    return answer == b"1"


def test_a_forked_child_gets_no_copy_of_the_slab():
    with HostSlab(4 << 20, pin=False) as slab:
        address = slab.tensor.data_ptr()
        assert "dc" in _mapping_flags(address)  # "do not copy" on fork
        assert not _mapped_in_child(address)
        assert _mapped_in_child(id(slab))  # the child has this process's other memory
