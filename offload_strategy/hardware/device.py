"""The GPU tier and the links to it: buffers, asynchronous copies, and the events that fence them.

The runtime talks to one :class:`Device` and never asks which kind it has:

- :class:`CudaDevice` copies on one side stream per direction and fences compute with CUDA events.
- :class:`EmulatedDevice` stands in for a GPU on CPU-only machines: the GPU tier is a budget of
  host memory, and one copy thread per direction makes transfers truly asynchronous (optionally
  throttled to a link's bandwidth), so every scheduling path, race and metric runs in CI.

The two copy streams (CUDA streams, or the emulated device's copy threads) are a
:class:`CopyStreams`, made once by its owner (the strategy makes them at set-up,
``make_copy_streams``) and handed to every device built for the same GPU: the engines a
re-placement builds copy on the same pair, and do not take new streams from PyTorch's pool
(32 streams per priority, handed out in turn), where a later stream can be one NCCL or another
engine already copies on. On CUDA the host-to-GPU stream has the highest priority there is.
A device built without a pair makes its own and releases it when it closes.

On CUDA, :meth:`Device.wait` orders later compute after a copy but lets the host run on: host
code may write, read or give back a copy's buffers only after waiting for its event on the host
(:meth:`Device.host_wait`, ``Event.wait``, :meth:`Device.synchronize`). The emulated device's
compute is the host's, so its ``wait`` blocks, and a missing host wait goes unseen. With a
:class:`RaceCheck` (``EmulatedDevice(race_check=...)``, or ``OFFLOAD_STRATEGY_RACE_CHECK=1`` in
the environment, as ``TORCH_CUDA_SANITIZER`` turns on PyTorch's check of CUDA streams; the test
suite runs under it) copies land late, after a random delay each unless something waits for them
first, and the books CUDA would keep are kept: each copy's buffers stay
in flight until the host has waited for it (or for a later copy ordered after it), and
:meth:`Device.check_host_access` raises :class:`CopyRaceError`, naming the buffer, the call that
touched it and the call that issued the copy, when the host touches one of them before.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import os
import queue
import random
import threading
import sys
import time
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Callable, NamedTuple, Optional

import torch

from ..config import HardwareSpec, format_bytes
from .numa import gpu_numa_node

_H2D, _D2H = "host-to-device", "device-to-host"
RACE_CHECK_ENV = "OFFLOAD_STRATEGY_RACE_CHECK"


class DeviceMemoryError(ValueError):
    """An allocation would exceed the capacity of the GPU tier.

    Not ``strategy.MemoryBudgetError``: nothing below the strategy imports it (docs/architecture.md, layers).
    """


class Event:
    """Completion of one asynchronous copy."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.issued_at = time.perf_counter()
        self.finished_at: Optional[float] = None
        self.error: Optional[BaseException] = None
        self._finished = threading.Event()
        self.on_host_wait: Optional[Callable[["Event"], None]] = None  # a RaceCheck's books
        self.hurry: Optional[Callable[[], None]] = None  # lands a late copy now that someone waits (_Link)

    def done(self) -> bool:
        """True once the copy has completed, or failed (then :meth:`wait` raises its error)."""
        return self._finished.is_set()

    def wait(self) -> float:
        """Block the calling host thread until the copy completes; return the seconds blocked."""
        blocked = 0.0
        if not self.done():
            start = time.perf_counter()
            self._block()
            blocked = time.perf_counter() - start
        if self.error is not None:
            raise self.error
        if self.on_host_wait is not None:
            self.on_host_wait(self)
        return blocked

    def _block(self) -> None:
        if self.hurry is not None:
            self.hurry()
        self._finished.wait()

    def _finish(self, error: Optional[BaseException]) -> None:
        self.error = error
        self.finished_at = time.perf_counter()
        self._finished.set()


class _CudaEvent(Event):
    """A copy on a CUDA stream. ``finished_at`` stays None: the host never sees the moment it ends."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.cuda_event = torch.cuda.Event(enable_timing=False)

    def done(self) -> bool:
        return self.cuda_event.query()

    def _block(self) -> None:
        self.cuda_event.synchronize()


class TimeMark:
    """A point on the compute's own timeline, recorded where the compute is queued (:meth:`Device.mark_time`).
    The emulated tier computes on the host, so its marks are the host's clock."""

    def __init__(self) -> None:
        self.at = time.perf_counter()


class _CudaTimeMark(TimeMark):
    """A timing event on the compute stream: it completes when the GPU reaches it, not when the host queues it."""

    def __init__(self, stream: "torch.cuda.Stream") -> None:
        super().__init__()
        self.cuda_event = torch.cuda.Event(enable_timing=True)
        self.cuda_event.record(stream)


class Device(abc.ABC):
    """The GPU tier (a capacity handed out by :meth:`allocate`) and the two links to it.

    Counters count bytes when a copy is issued. Copies may be issued from several threads: a lock
    keeps the counters exact and makes issue order the completion order within one direction.
    """

    is_emulated: bool
    # the NUMA node host memory for this GPU's copies should come from (None: no preference)
    numa_node: Optional[int] = None

    def __init__(self, compute: torch.device, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity={capacity!r} must be a non-negative number of bytes.")
        self.compute = compute
        self.capacity = capacity
        self.allocated = 0
        self.bytes_to_device = 0
        self.bytes_to_host = 0
        self._closed = False
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 buffer of ``nbytes`` on :attr:`compute`.

        Memory pools call this a few times at setup and sub-allocate, so the device only keeps the
        books; nothing is ever given back.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r} must be a non-negative number of bytes.")
        with self._lock:
            if self.allocated + nbytes > self.capacity:
                raise DeviceMemoryError(
                    f"allocating {format_bytes(nbytes)} in the GPU tier would bring it to "
                    f"{format_bytes(self.allocated + nbytes)}, over its capacity of {format_bytes(self.capacity)} "
                    f"({format_bytes(self.allocated)} already allocated). Raise gpu_memory, or lower the model's "
                    f"footprint (smaller batch, fewer persistent parameters, more offloading)."
                )
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.compute)
            self.allocated += nbytes
        return buffer

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Queue a copy of ``src`` (host memory) into ``dst`` (the GPU tier); returns at once."""
        return self._copy(_H2D, dst, src)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Queue a copy of ``src`` (the GPU tier) into ``dst`` (host memory); returns at once."""
        return self._copy(_D2H, dst, src)

    def _copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> Event:
        # Copies move bytes, so a bf16 parameter can land in a uint8 pool slot of the same size.
        dst_bytes, src_bytes = _as_bytes(dst, "dst"), _as_bytes(src, "src")
        nbytes = src_bytes.numel()
        if dst_bytes.numel() != nbytes:
            raise ValueError(
                f"{direction} copy: dst holds {dst_bytes.numel()} bytes ({format_bytes(dst_bytes.numel())}) but "
                f"src holds {nbytes} bytes ({format_bytes(nbytes)}); give a destination of exactly the source's size."
            )
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{direction} copy issued on a closed {type(self).__name__}; create a new device.")
            event = self._issue(direction, dst_bytes, src_bytes)
            if direction == _H2D:
                self.bytes_to_device += nbytes
            else:
                self.bytes_to_host += nbytes
        return event

    @abc.abstractmethod
    def _issue(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Start copying the uint8 tensor ``src`` into ``dst`` (same size) without waiting for it."""

    @abc.abstractmethod
    def wait(self, event: Event) -> float:
        """Make later compute on :attr:`compute` see the copy's result; return seconds the host blocked."""

    def host_wait(self, event: Event) -> float:
        """Block the host until the copy has completed (then the host may touch its buffers); return
        the seconds blocked."""
        return event.wait()

    def check_host_access(self, tensor: torch.Tensor, action: str) -> None:
        """The host is about to ``action`` (``"writes"``, ``"reads"``, ``"releases"``: with what)
        ``tensor``'s memory: raise :class:`CopyRaceError` where a copy may still be using it
        (only an emulated device with a :class:`RaceCheck` keeps the books)."""

    def compute_done(self) -> Event:
        """An event that completes with the compute queued so far (on the emulated tier compute is
        synchronous: already complete). The host waits on it before reading what a kernel wrote
        into host memory through a direct-host-access view."""
        event = Event(0)
        event._finish(None)
        return event

    def compute_stream(self) -> contextlib.AbstractContextManager:
        """A context in which another host thread queues its kernels where this thread queues its
        compute now (CUDA: this thread's current stream), so that they run after what it queued."""
        return contextlib.nullcontext()

    def mark_time(self) -> TimeMark:
        """A mark on the compute's timeline at the compute queued so far (read it with
        :meth:`seconds_between`; on CUDA a kernel's launch and its run are apart)."""
        return TimeMark()

    def seconds_between(self, start: TimeMark, end: TimeMark) -> float:
        """The compute's seconds from ``start`` to ``end`` (on CUDA the host waits for ``end`` first)."""
        return end.at - start.at

    def reserved_beyond_allocated(self) -> int:
        """What the device's allocator reserved beyond what it allocated, at their peaks since
        set-up: memory the process holds that no tensor uses (fragmentation), which a GPU tier
        of "all that is free" must leave room for. The emulated tier has no caching allocator:
        its ``reserve`` (0 unless a test sets one)."""
        return 0

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Return once every queued copy has completed."""

    def close(self) -> None:
        """Finish queued copies and release the copy machinery. Idempotent."""
        with self._lock:
            self._closed = True
        self._release()

    @abc.abstractmethod
    def _release(self) -> None: ...

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _as_bytes(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(
            f"{name} (shape {tuple(tensor.shape)}, strides {tensor.stride()}) is not contiguous; copies move raw "
            f"bytes, so pass a contiguous tensor (call .contiguous() first)."
        )
    return tensor.reshape(-1).view(torch.uint8)


class _Link:
    """One direction of the emulated link: a FIFO served by one thread, so copies finish in issue order.

    A copy given a delay (a :class:`RaceCheck`'s late landing) waits that long before it starts,
    or less: a wait for it, or for a later copy on the link, lands it at once. A copy nobody waits
    for lands late, and the suite, which runs under the race check, pays for the delays only where
    no one waits.

    It holds no reference to its device, so a device dropped without ``close()`` can still be
    collected and stop its threads. They are daemons: a script that ends without tearing the
    strategy down (a Fabric loop) must not wait on them at exit, and no copy outlives the process.
    """

    def __init__(self, name: str, gbps: Optional[float]) -> None:
        self._seconds_per_byte = 0.0 if gbps is None else 1.0 / (gbps * 1e9)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._last: Optional[Event] = None
        self._issued = 0  # copies put on the link
        self._hurried = 0  # copies up to this one land without their delay
        self._waited = threading.Condition()
        self._putting = threading.Lock()
        self.failure: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._serve, name=f"offload-{name}", daemon=True)
        self.thread.start()

    def put(self, event: Event, dst: torch.Tensor, src: torch.Tensor, delay: float = 0.0) -> None:
        with self._putting:  # two devices may share the link (CopyStreams): their copies numbered in one order
            self._last = event
            self._issued += 1
            event.hurry = functools.partial(self.hurry, self._issued)
            self._queue.put((event, dst, src, delay, self._issued))

    def hurry(self, through: int) -> None:
        """Copies up to the ``through``-th land as soon as the link reaches them (someone waits)."""
        with self._waited:
            if through > self._hurried:
                self._hurried = through
                self._waited.notify_all()

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            self._run(*item)
            item = None  # drop the buffers while idle

    def _run(self, event: Event, dst: torch.Tensor, src: torch.Tensor, delay: float, number: int) -> None:
        if delay > 0:  # a RaceCheck's late landing
            with self._waited:
                self._waited.wait_for(lambda: self._hurried >= number, timeout=delay)
        start = time.perf_counter()
        try:
            dst.copy_(src)
        except BaseException as err:  # the waiter re-raises it; the link keeps serving
            self.failure = self.failure or err
            event._finish(err)
            return
        # A real link is busy for nbytes / bandwidth: hold later copies back as long.
        time.sleep(max(0.0, event.nbytes * self._seconds_per_byte - (time.perf_counter() - start)))
        event._finish(None)

    def settle(self) -> None:
        """Return once every copy queued so far has completed (failed ones included)."""
        last = self._last
        if last is not None:
            last._block()

    def drain(self) -> None:
        """Settle, then raise the first copy's failure since the last drain."""
        self.settle()
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def stop(self) -> None:
        self.hurry(self._issued)
        self._queue.put(None)  # after every queued copy, so they all complete
        if self.thread is not threading.current_thread():  # a collection may run on the worker itself
            self.thread.join()


def _stop_links(links: tuple[_Link, ...]) -> None:
    for link in links:
        link.stop()


@dataclass(frozen=True)
class StreamPriorities:
    """The priorities of the two copy streams, as CUDA numbers them: lower runs first."""

    to_device: int
    to_host: int


DEFAULT_STREAM_PRIORITY = 0  # CUDA's default, and the least priority there is


class CopyStreams(abc.ABC):
    """The two copy streams of one process on one GPU (see the module docstring): made once by
    :func:`make_copy_streams` and handed to every :class:`Device` built for that GPU. Whoever made
    them closes them once no device copies on them any more; a device's close only waits for
    the copies queued on them."""

    device: torch.device

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Finish the copies queued on them and release them. Idempotent."""


class CudaCopyStreams(CopyStreams):
    """Two CUDA streams, each taken once from PyTorch's pool: host-to-GPU at the greatest
    priority the GPU offers (``torch.cuda.Stream.priority_range()``: a copy into the GPU tier
    is what the compute waits for next), GPU-to-host at the default (a gradient's copy out can
    wait). A high-priority stream comes from the pool's high-priority streams, which NCCL
    does not use unless its process group asks for them."""

    def __init__(self, device: torch.device) -> None:
        self.device = _cuda_device(device)
        with torch.cuda.device(self.device):
            least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # static at run time; the stub says method
        self.priorities = StreamPriorities(to_device=min(least, greatest), to_host=DEFAULT_STREAM_PRIORITY)
        self.to_device = torch.cuda.Stream(self.device, priority=self.priorities.to_device)
        self.to_host = torch.cuda.Stream(self.device, priority=self.priorities.to_host)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if not self._closed:  # a pool's streams are never destroyed: nothing to give back but the wait
            self.to_device.synchronize()
            self.to_host.synchronize()
            self._closed = True


class EmulatedCopyStreams(CopyStreams):
    """The emulated device's two links, a copy thread each (optionally throttled to
    ``h2d_gbps``/``d2h_gbps``), shared like CUDA streams: the devices built on them copy on the
    same two threads, in one order per direction. No priorities: the host's scheduler runs both."""

    def __init__(self, h2d_gbps: Optional[float] = None, d2h_gbps: Optional[float] = None) -> None:
        for name, gbps in (("h2d_gbps", h2d_gbps), ("d2h_gbps", d2h_gbps)):
            if gbps is not None and not gbps > 0:
                raise ValueError(f"{name}={gbps!r} must be > 0 GB/s, or None for an unthrottled link.")
        self.device = torch.device("cpu")
        self.to_device = _Link("h2d", h2d_gbps)
        self.to_host = _Link("d2h", d2h_gbps)
        # the threads stop with the streams, closed or dropped: the links hold no reference back
        self._stop = weakref.finalize(self, _stop_links, (self.to_device, self.to_host))

    @property
    def closed(self) -> bool:
        return not self._stop.alive

    def close(self) -> None:
        self._stop()  # runs once, however often it is called


def _cuda_device(device: torch.device) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"CudaDevice needs a cuda device, got {device}; use EmulatedDevice (or make_device).")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _open_streams(kind: type, streams: CopyStreams, device: torch.device) -> None:
    """Refuse streams a device cannot copy on: of another kind, of another GPU, or closed."""
    if not isinstance(streams, kind) or streams.device != device:
        raise ValueError(
            f"copy streams {type(streams).__name__} on {streams.device} given to a device on {device}: make them for that "
            f"device (make_copy_streams(root) with the device's own root)."
        )
    if streams.closed:
        raise ValueError(f"the copy streams on {device} are closed: make new ones (make_copy_streams) for a device built after their close.")


class CopyRaceError(RuntimeError):
    """The host touched a buffer a copy may still be reading or writing (see :class:`RaceCheck`)."""


@dataclass
class _InFlight:
    event: Event
    direction: str
    dst: tuple[int, int]  # [start, end) addresses
    src: tuple[int, int]
    issued_by: _Call
    order: int  # in the order copies were issued
    ordered_compute_at: Optional[int] = None  # the issue order when compute was made to wait for it
    # the copy's GPU-tier side, held while booked: CUDA's caching allocator reuses no memory a
    # copy stream still uses (``record_stream``), so no later tensor, a host buffer least of all,
    # takes its addresses while the copy is in the books (freed, an emulated tier's memory could)
    device_side: Optional[torch.Tensor] = None


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


class _Call(NamedTuple):
    """Where a call was made, formatted only for an error's message."""

    filename: str
    lineno: int
    name: str

    def __str__(self) -> str:
        return f"{os.path.relpath(self.filename)}:{self.lineno} ({self.name})"


def _caller() -> _Call:
    """The innermost frame outside this module: the call that issued or touched a buffer. Read
    off the frames, not ``traceback.extract_stack`` (which reads every frame's source line: a
    millisecond a copy under Lightning's stack, most of what the race check cost the suite)."""
    frame: Optional[FrameType] = sys._getframe(2)  # past this function and the race check's own
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.endswith(("device.py", "pools.py")) and code.co_name != "<lambda>":
            return _Call(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return _Call("?", 0, "?")


class RaceCheck:
    """CUDA's ordering of copies, kept as books on the emulated device (see the module docstring).

    A copy stays in flight until the host waits for it, or for a copy the stream order puts after
    it: a later copy in the same direction (one stream each), or any copy issued after compute was
    made to wait for it (each copy waits for the compute queued before it), or the compute queued
    after that wait (``compute_done``). Each copy lands after a random delay of up to
    ``max_delay_s`` (drawn from ``seed``), so a buffer used before its copy lands holds the wrong
    bytes as well; a wait for it (or a later copy on its link) lands it at once, so that a run
    whose waits are all in place is hardly slower."""

    def __init__(self, max_delay_s: float = 0.002, seed: int = 0) -> None:
        self.max_delay_s = max_delay_s
        self._random = random.Random(seed)
        self._in_flight: list[_InFlight] = []
        self._issued = 0
        self._lock = threading.Lock()

    def issued(self, event: Event, direction: str, dst: torch.Tensor, src: torch.Tensor) -> float:
        """Book a copy just issued; the seconds its landing is delayed by."""
        with self._lock:
            self._issued += 1
            device_side = src if direction == _D2H else dst
            self._in_flight.append(_InFlight(event, direction, _span(dst), _span(src), _caller(), self._issued, device_side=device_side))
            event.on_host_wait = self._host_waited
            return self._random.uniform(0.0, self.max_delay_s)

    def compute_ordered(self, event: Event) -> None:
        with self._lock:
            for r in self._in_flight:
                if r.event is event and r.ordered_compute_at is None:
                    r.ordered_compute_at = self._issued

    def compute_done(self) -> Event:
        """An event for the compute queued so far: once the host has waited for it, so has it for
        every copy compute was made to wait for."""
        with self._lock:
            issued = self._issued
        event = Event(0)
        event._finish(None)
        event.on_host_wait = lambda _: self._forget(lambda r: r.ordered_compute_at is not None and r.ordered_compute_at <= issued)
        return event

    def _host_waited(self, event: Event) -> None:
        with self._lock:
            waited = next((r for r in self._in_flight if r.event is event), None)
        if waited is not None:
            self._forget(lambda r: r is waited or (r.direction == waited.direction and r.order < waited.order)
                         or (r.ordered_compute_at is not None and r.ordered_compute_at < waited.order))

    def _forget(self, landed: Callable[[_InFlight], bool]) -> None:
        with self._lock:
            self._in_flight = [r for r in self._in_flight if not landed(r)]

    def all_waited(self) -> None:
        with self._lock:
            self._in_flight = []

    def check(self, tensor: torch.Tensor, action: str) -> None:
        start, end = _span(tensor)
        with self._lock:
            for r in self._in_flight:
                for role, (lo, hi) in (("write", r.dst), ("read", r.src)):
                    if lo < end and start < hi:
                        raise CopyRaceError(
                            f"{_caller()}: the host {action} ({end - start} bytes at {start:#x}) while the {r.direction} copy "
                            f"issued at {r.issued_by} may still {role} it: no host wait for that copy's event (Device.wait "
                            f"orders compute only, as on CUDA). Wait for it first (Device.host_wait)."
                        )


class EmulatedDevice(Device):
    """A GPU tier emulated in host memory, with asynchronous (optionally throttled) copy links.

    With ``h2d_gbps``/``d2h_gbps`` set, a copy of n bytes takes at least n / (gbps * 1e9) seconds
    on its link, so a CPU run can behave like, e.g., PCIe 4.0 x16 (31.5 GB/s). With
    ``race_check``, copies land late and a host access to a copy's buffers before a host wait
    for it raises (:class:`RaceCheck`).
    """

    is_emulated = True

    def __init__(self, capacity: int, h2d_gbps: Optional[float] = None, d2h_gbps: Optional[float] = None,
                 race_check: Optional[RaceCheck] = None, streams: Optional[CopyStreams] = None) -> None:
        """``streams``: the links to copy on (:class:`EmulatedCopyStreams`, their bandwidths
        their own); without them the device makes its own from ``h2d_gbps``/``d2h_gbps``."""
        super().__init__(torch.device("cpu"), capacity)
        self._owns_streams = streams is None
        if streams is None:
            streams = EmulatedCopyStreams(h2d_gbps, d2h_gbps)
        elif h2d_gbps is not None or d2h_gbps is not None:
            raise ValueError("EmulatedDevice: h2d_gbps/d2h_gbps given with streams; the streams' links have their bandwidths already.")
        _open_streams(EmulatedCopyStreams, streams, self.compute)
        assert isinstance(streams, EmulatedCopyStreams)
        self.streams = streams
        self.race_check = race_check
        self.reserve = 0  # what a caching allocator would hold beyond its allocations (reserved_beyond_allocated)
        self.numa_node = None  # the emulated GPU's NUMA node: none unless a test gives one
        self._links = {_H2D: streams.to_device, _D2H: streams.to_host}

    def _issue(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> Event:
        event = Event(src.numel())
        delay = self.race_check.issued(event, direction, dst, src) if self.race_check is not None else 0.0
        self._links[direction].put(event, dst, src, delay)
        return event

    def wait(self, event: Event) -> float:
        """Compute runs on the host here, so making it see the copy means blocking the host (under
        a race check, without counting as the host's wait: on CUDA it would not be one)."""
        if self.race_check is None:
            return event.wait()
        start = time.perf_counter()
        event._block()
        if event.error is not None:
            raise event.error
        self.race_check.compute_ordered(event)
        return time.perf_counter() - start

    def compute_done(self) -> Event:
        return self.race_check.compute_done() if self.race_check is not None else super().compute_done()

    def reserved_beyond_allocated(self) -> int:
        return self.reserve

    def check_host_access(self, tensor: torch.Tensor, action: str) -> None:
        if self.race_check is not None:
            self.race_check.check(tensor, action)

    def synchronize(self) -> None:
        """Wait for every queued copy; raise the first error of a copy that failed since the last call."""
        for link in self._links.values():
            link.drain()
        if self.race_check is not None:
            self.race_check.all_waited()

    def _release(self) -> None:
        if self._owns_streams:
            self.streams.close()
            return
        for link in self._links.values():  # shared: the next device copies on them
            link.settle()


class CudaDevice(Device):
    """A CUDA GPU: one side stream per direction, so copies overlap compute and each other."""

    is_emulated = False

    def __init__(self, device: torch.device, capacity: int, streams: Optional[CopyStreams] = None) -> None:
        """``streams``: the process's copy streams on this GPU (:class:`CudaCopyStreams`); without
        them the device takes its own pair from PyTorch's pool."""
        device = _cuda_device(device)
        super().__init__(device, capacity)
        self._owns_streams = streams is None
        if streams is None:
            streams = CudaCopyStreams(device)
        _open_streams(CudaCopyStreams, streams, device)
        assert isinstance(streams, CudaCopyStreams)
        self.streams = streams
        self._streams = {_H2D: streams.to_device, _D2H: streams.to_host}
        self.numa_node = gpu_numa_node(device.index if device.index is not None else torch.cuda.current_device())

    def _issue(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> Event:
        stream = self._streams[direction]
        event = _CudaEvent(src.numel())
        # dst may be a buffer compute is still reading: overwrite it only after the work queued so far.
        stream.wait_stream(torch.cuda.current_stream(self.compute))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        for tensor in (dst, src):
            if tensor.is_cuda:  # keep the caching allocator from reusing its memory mid-copy
                tensor.record_stream(stream)
        event.cuda_event.record(stream)
        return event

    def wait(self, event: Event) -> float:
        """Order later compute after the copy on the GPU; the host does not block."""
        if not isinstance(event, _CudaEvent):
            raise TypeError(f"{event!r} was not issued by a CudaDevice; wait on it with the device that issued it.")
        torch.cuda.current_stream(self.compute).wait_event(event.cuda_event)
        return 0.0

    def compute_done(self) -> Event:
        event = _CudaEvent(0)
        event.cuda_event.record(torch.cuda.current_stream(self.compute))
        return event

    def compute_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(torch.cuda.current_stream(self.compute))

    def mark_time(self) -> TimeMark:
        return _CudaTimeMark(torch.cuda.current_stream(self.compute))

    def reserved_beyond_allocated(self) -> int:
        # the peaks since set-up reset them (TieredCore.resolve)
        return max(torch.cuda.max_memory_reserved(self.compute) - torch.cuda.max_memory_allocated(self.compute), 0)

    def seconds_between(self, start: TimeMark, end: TimeMark) -> float:
        if not isinstance(start, _CudaTimeMark) or not isinstance(end, _CudaTimeMark):
            raise TypeError("time marks not made by a CudaDevice; read them with the device that made them.")
        end.cuda_event.synchronize()  # the later mark done: so is the earlier one, on the same stream
        return start.cuda_event.elapsed_time(end.cuda_event) / 1e3

    def synchronize(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def _release(self) -> None:
        self.synchronize()
        if self._owns_streams:
            self.streams.close()


def make_copy_streams(root: torch.device, spec: Optional[HardwareSpec] = None, throttle: bool = False) -> CopyStreams:
    """The copy streams for devices on ``root``: a CUDA stream per direction on cuda, an emulated
    link (a copy thread) per direction anywhere else, throttled to the spec's bandwidths with
    ``throttle`` (as :func:`make_device` throttles). The caller owns them: close them once no
    device copies on them."""
    root = torch.device(root)
    if root.type == "cuda":
        return CudaCopyStreams(root)
    if throttle and spec is not None:
        return EmulatedCopyStreams(h2d_gbps=spec.h2d_gbps, d2h_gbps=spec.d2h_gbps)
    return EmulatedCopyStreams()


def make_device(
    root: torch.device, capacity: int, spec: Optional[HardwareSpec] = None, throttle: bool = False, streams: Optional[CopyStreams] = None,
) -> Device:
    """The device for ``root``: a CudaDevice on cuda, an EmulatedDevice anywhere else.

    ``streams``: the copy streams it copies on (:func:`make_copy_streams`, their links' bandwidths
    set there); without them it makes its own, and with ``throttle`` and a ``spec`` the emulated
    links run at the spec's H2D/D2H bandwidths (a bandwidth the spec leaves unknown stays
    unthrottled). ``OFFLOAD_STRATEGY_RACE_CHECK=<seed>`` in the environment (any whole number
    but 0) gives the emulated device a :class:`RaceCheck`.
    """
    root = torch.device(root)
    if root.type == "cuda":
        return CudaDevice(root, capacity, streams=streams)
    race_check = RaceCheck(seed=int(os.environ[RACE_CHECK_ENV])) if os.environ.get(RACE_CHECK_ENV, "0") not in ("", "0") else None
    if streams is not None:
        return EmulatedDevice(capacity, race_check=race_check, streams=streams)
    if throttle and spec is not None:
        return EmulatedDevice(capacity, h2d_gbps=spec.h2d_gbps, d2h_gbps=spec.d2h_gbps, race_check=race_check)
    return EmulatedDevice(capacity, race_check=race_check)
