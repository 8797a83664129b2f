"""NvmeStore: exact round trips on the O_DIRECT and buffered paths, privacy, cleanup, budgets."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from offload_strategy.memory.nvme import PAGE, NvmeSpaceError, NvmeStore

MiB = 1024**2
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool)


def _random(nbytes: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaNs included), so a round trip is checked bit for bit."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype) if dtype != torch.bool else raw % 2 == 1


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def store(request, tmp_path):
    with NvmeStore(tmp_path / "nvme", capacity=64 * MiB, workers=3, direct=request.param) as s:
        yield s


def _aligned(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A page-aligned tensor (an mmap), as the pinned slab hands them out."""
    buf = mmap.mmap(-1, max(nbytes, 1))
    return buf, torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


def test_falls_back_to_buffered_io_where_o_direct_is_refused(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):  # what tmpfs before Linux 6.6 does
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with NvmeStore(tmp_path, capacity=MiB) as s:
        assert s.direct is False
        src = _random(3 * PAGE + 5, torch.uint8)
        s.write("k", src).result()
        out = torch.empty_like(src)
        s.read("k", out).result()
        assert torch.equal(out, src)
        assert (s.path / "00000000.bin").stat().st_size == src.numel()  # buffered files are not padded
    with NvmeStore(tmp_path, capacity=MiB, direct=False) as s:
        assert s.direct is False


def test_works_on_tmpfs(tmp_path):
    if not os.path.isdir("/dev/shm") or shutil.disk_usage("/dev/shm").free < 16 * MiB:
        pytest.skip("no tmpfs at /dev/shm")
    with NvmeStore("/dev/shm", capacity=MiB) as s:  # O_DIRECT on Linux >= 6.6, buffered before
        src = _random(5000, torch.uint8)
        s.write("k", src).result()
        out = torch.empty_like(src)
        s.read("k", out).result()
        assert torch.equal(out, src)
    assert not s.path.exists()


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_of_aligned_tensors_is_exact(store, dtype):
    nbytes = 3 * 8 * MiB + 2 * PAGE  # several chunks in flight, page-multiple length
    buf, src = _aligned(nbytes)
    bits = _random(nbytes, torch.uint8, seed=1)
    src.copy_(bits % 2 if dtype == torch.bool else bits)
    src = src.view(dtype)
    _, dst_raw = _aligned(src.numel() * src.element_size())
    dst = dst_raw.view(src.dtype)
    store.write("t", src).result()
    store.read("t", dst).result()
    assert _same_bytes(dst, src)
    assert not torch.equal(dst_raw, torch.zeros_like(dst_raw))


@pytest.mark.parametrize("nbytes", [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 5, 8 * 1024**2 + 7])
@pytest.mark.parametrize("offset", [0, 1])
def test_round_trip_of_odd_sizes_and_unaligned_sources(store, nbytes, offset):
    base = _random(nbytes + offset, torch.uint8, seed=nbytes)
    src = base[offset:]  # offset 1: an address no O_DIRECT transfer may use directly
    store.write("odd", src).result()
    backing = torch.zeros(nbytes + 1, dtype=torch.uint8)
    dst = backing[1:]  # unaligned destination too
    store.read("odd", dst).result()
    assert torch.equal(dst, src)
    assert backing[0] == 0  # nothing written before dst
    if store.direct:
        assert (store.path / "00000000.bin").stat().st_size % PAGE == 0


def test_aligned_source_with_odd_length_reads_back_into_any_buffer(store):
    buf, src = _aligned(2 * PAGE + 100)
    src.copy_(_random(2 * PAGE + 100, torch.uint8, seed=3))
    store.write("a", src).result()
    out = torch.empty(2 * PAGE + 100, dtype=torch.uint8)
    store.read("a", out).result()
    assert torch.equal(out, src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_shaped_tensors_of_any_dtype(store, dtype):
    src = _random(6 * 1000 * 4, dtype).reshape(6, -1)
    store.write("w", src).result()
    dst = torch.empty_like(src)
    store.read("w", dst).result()
    assert _same_bytes(dst, src)


def test_overwrite_replaces_content_and_size(store):
    big, small = _random(10 * PAGE, torch.uint8, 1), _random(100, torch.uint8, 2)
    store.write("k", big).result()
    store.write("k", small).result()
    assert store.used_bytes == 100
    out = torch.empty(100, dtype=torch.uint8)
    store.read("k", out).result()
    assert torch.equal(out, small)
    with pytest.raises(ValueError, match="holds 100 bytes"):
        store.read("k", torch.empty(10 * PAGE, dtype=torch.uint8))


def test_files_are_private(store):
    store.write("secret", _random(PAGE, torch.uint8)).result()
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o700
    files = sorted(store.path.iterdir())
    assert [f.name for f in files] == ["00000000.bin", "owner.lock"]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert str(os.getpid()) in store.path.name


def test_close_removes_everything_and_is_idempotent(tmp_path):
    s = NvmeStore(tmp_path, capacity=MiB)
    fut = s.write("k", _random(3 * PAGE + 1, torch.uint8))
    s.close()  # waits for the pending write
    assert fut.done() and fut.exception() is None
    assert not s.path.exists() and list(tmp_path.iterdir()) == []
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.write("k", torch.ones(1))


def test_directory_removed_when_the_with_block_raises(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with NvmeStore(tmp_path, capacity=MiB) as s:
            s.write("k", _random(PAGE, torch.uint8))
            1 / 0
    assert not s.path.exists()


@pytest.mark.parametrize("direct", [True, False])
def test_capacity_exceeded_names_the_numbers(tmp_path, direct):
    with NvmeStore(tmp_path, capacity=MiB, direct=direct) as s:
        s.write("a", torch.ones(768 * 1024, dtype=torch.uint8)).result()
        with pytest.raises(NvmeSpaceError, match=r"would use 1.25 MiB of its capacity 1.00 MiB") as info:
            s.write("b", torch.empty(512 * 1024, dtype=torch.uint8))
        assert isinstance(info.value, ValueError) and "'b'" in str(info.value)
        assert s.used_bytes == 768 * 1024 and "b" not in [p.name for p in s.path.iterdir()]
        s.write("a", torch.ones(MiB, dtype=torch.uint8)).result()  # overwrite counts the old size as freed
        s.delete("a")
        assert s.used_bytes == 0 and [f.name for f in s.path.iterdir()] == ["owner.lock"]
        s.write("b", torch.empty(MiB, dtype=torch.uint8)).result()  # freed space is reusable


def test_capacity_beyond_free_disk_refused_before_writing(tmp_path):
    root = tmp_path / "not-yet"
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(NvmeSpaceError, match="free") as info:
        NvmeStore(root, capacity=free + 1024**4)
    assert "TiB" in str(info.value) or "GiB" in str(info.value)
    assert not root.exists() and list(tmp_path.iterdir()) == []


def test_unknown_key_and_bad_tensors(store):
    with pytest.raises(KeyError, match="nope"):
        store.read("nope", torch.empty(4))
    store.delete("nope")  # deleting what is not there is fine
    with pytest.raises(ValueError, match="contiguous"):
        store.write("t", torch.zeros(4, 4).t())


def test_buffered_and_direct_files_hold_the_same_bytes(tmp_path):
    src = _random(5 * PAGE + 17, torch.uint8, seed=9)
    contents = []
    for direct in (True, False):
        with NvmeStore(tmp_path / str(direct), capacity=MiB, direct=direct) as s:
            s.write("k", src).result()
            contents.append((s.path / "00000000.bin").read_bytes()[: src.numel()])
    assert contents[0] == contents[1] == src.numpy().tobytes()


def test_counters_count(store):
    a, b = _random(3 * PAGE + 5, torch.uint8), _random(12 * MiB, torch.uint8)
    futures = [store.write("a", a), store.write("b", b)]
    for f in futures:
        f.result()
    store.read("b", torch.empty_like(b)).result()
    assert store.bytes_written == a.numel() + b.numel()
    assert store.bytes_read == b.numel()
    assert store.used_bytes == a.numel() + b.numel()


def test_io_errors_name_key_size_and_directory(store):
    store.write("k", _random(PAGE, torch.uint8)).result()
    shutil.rmtree(store.path)  # the directory vanished under us (as a full or failed disk would)
    fut = store.write("k2", _random(PAGE, torch.uint8))
    err = fut.exception(timeout=10)
    assert isinstance(err, OSError)
    assert "'k2'" in str(err) and "4.00 KiB" in str(err) and str(store.path) in str(err)
    store.path.mkdir()  # let close() find something to remove


@pytest.mark.nvme
def test_large_tensor_round_trip(tmp_path):
    nbytes = 512 * MiB + 3
    src = _random(nbytes, torch.uint8, seed=5)
    with NvmeStore(tmp_path, capacity=nbytes) as s:
        s.write("big", src).result()
        dst = torch.empty_like(src)
        s.read("big", dst).result()
    assert torch.equal(dst, src)


def test_a_killed_run_leaves_a_directory_the_next_run_removes(tmp_path):
    """SIGKILL skips every cleanup; the dead run's lock is free, so the next store removes its files,
    while a live run's directory is left alone."""
    import signal
    import subprocess
    import sys
    import textwrap

    root = tmp_path / "nvme"
    code = textwrap.dedent(f"""
        import os, signal, torch
        from offload_strategy.memory.nvme import NvmeStore
        store = NvmeStore({str(root)!r}, capacity=1 << 20)
        store.write("x", torch.ones(4096, dtype=torch.uint8)).result()
        print(store.path, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    dead = Path(result.stdout.strip())
    assert dead.is_dir() and any(dead.iterdir()), "the killed run left nothing to clean"
    with pytest.warns(UserWarning, match=f"removed 1 NVMe swap directory .* {dead.name}"):
        live = NvmeStore(root, capacity=1 << 20)
    with live:
        assert live.removed_stale == [dead] and not dead.exists()
        with NvmeStore(root, capacity=1 << 20) as other:
            assert other.removed_stale == [] and live.path.is_dir(), "a live run's directory was removed"


def test_checksums_catch_data_that_comes_back_different(tmp_path):
    from offload_strategy.memory.nvme import NvmeChecksumError

    with NvmeStore(tmp_path, capacity=1 << 20, checksums=True) as store:
        data = _random(3 * PAGE + 5, torch.uint8)
        store.write("x", data).result()
        out = torch.empty_like(data)
        store.read("x", out).result()
        assert torch.equal(out, data)
        (file,) = [f for f in store.path.iterdir() if f.suffix == ".bin"]
        with open(file, "r+b") as handle:  # the disk flips a bit
            handle.seek(100)
            byte = handle.read(1)
            handle.seek(100)
            handle.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(NvmeChecksumError, match="came back different from what was written"):
            store.read("x", out).result()


def _as_other_user(uid: int, action) -> int:
    """Run ``action()`` in a forked child under ``uid``; its exit status (0: returned True)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgid(uid)
            os.setuid(uid)
            os._exit(0 if action() else 1)
        except BaseException:
            os._exit(2)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _foreign_stale_run(root: Path, uid: int) -> Path:
    """A run directory of another user, its owner lock free (that run was killed), mode 0700."""
    foreign = root / "offload-999999-theirs"
    foreign.mkdir(mode=0o700)
    (foreign / "owner.lock").write_text("999999")
    (foreign / "00000000.bin").write_bytes(b"x" * 4096)
    for path in (foreign / "owner.lock", foreign / "00000000.bin", foreign):
        os.chown(path, uid, uid)
    return foreign


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to act as two users")
def test_a_shared_nvme_path_with_another_users_run_directory(tmp_path):
    """A scratch directory shared by users (mode 1777): another user's run directory, even a stale
    one, neither blocks a run nor is touched by it."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="shared-scratch-"))  # beside /tmp's own: reachable by every user
    try:
        _shared_scratch_cases(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _shared_scratch_cases(root: Path) -> None:
    from offload_strategy.memory.nvme import create_run_directory, remove_stale_run_directories

    os.chmod(root, 0o1777)
    foreign = _foreign_stale_run(root, uid=54321)

    def run_as_second_user() -> bool:
        removed = remove_stale_run_directories(root)
        run = create_run_directory(root)
        os.close(run.owner)
        os.close(run.fd)
        return removed == [] and run.path.is_dir()

    assert _as_other_user(54322, run_as_second_user) == 0, "another user's directory blocked the run"
    assert remove_stale_run_directories(root) == [] and (foreign / "00000000.bin").exists(), "another user's directory was touched"
    with NvmeStore(root, capacity=1 << 20) as store:
        assert store.removed_stale == [] and foreign.is_dir()


def test_a_run_directory_is_never_visible_before_its_lock_is_held(tmp_path, monkeypatch):
    """Ranks of one node start together: a second run's stale-run cleanup, at the moment the first
    takes its owner lock, must not take the first's new directory for a killed run's."""
    import fcntl

    from offload_strategy.memory import nvme

    root = tmp_path / "nvme"
    root.mkdir()
    original, seen = fcntl.flock, []

    def flock_after_a_second_run_looked(fd: int, operation: int) -> None:
        if not seen:
            seen.append(None)
            seen[0] = nvme.remove_stale_run_directories(root)  # the second run, right now
        return original(fd, operation)

    monkeypatch.setattr(nvme.fcntl, "flock", flock_after_a_second_run_looked)
    with NvmeStore(root, capacity=1 << 20) as store:
        monkeypatch.setattr(nvme.fcntl, "flock", original)
        assert seen == [[]], "the second run removed a live run's directory"
        store.write("x", torch.ones(4096, dtype=torch.uint8)).result()
        assert store.path.is_dir() and store.path.name.startswith("offload-")
