"""One background thread that runs tasks in the order they are submitted: unit updates, and the
host's share of work autograd's thread only queues (a gradient added into its home once its copy
has landed, a reduction launched once its gradients have)."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Optional


class Pending:
    """A task on a worker. ``wait`` returns once it has run, raising what it raised (or, where the
    worker skipped it after an earlier task failed, that failure)."""

    def __init__(self, task: Callable[[], None], worker: threading.Thread) -> None:
        self._task: Optional[Callable[[], None]] = task
        self._worker = worker
        self._done = threading.Event()
        self.error: Optional[BaseException] = None

    def done(self) -> bool:
        return self._done.is_set()

    def run(self) -> None:
        task, self._task = self._task, None  # dropped once run: what it holds is freed
        try:
            assert task is not None, "a task runs once"
            task()
        except BaseException as error:
            self.error = error
            raise
        finally:
            self._done.set()

    def skip(self, error: BaseException) -> None:
        self._task, self.error = None, error
        self._done.set()

    def wait(self) -> None:
        if not self._done.is_set():
            if threading.current_thread() is self._worker:  # queued behind the task waiting for it: it never would run
                raise RuntimeError("a task on the worker waited for a task queued after it; submit what it needs first.")
            self._done.wait()
        if self.error is not None:
            raise self.error


class UpdateWorker:
    """Runs submitted callables one at a time on its own thread; ``drain`` waits for all of them
    and re-raises the first exception any of them raised."""

    def __init__(self, name: str = "offload-update") -> None:
        self._queue: "queue.Queue[Optional[Pending]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)  # never keeps a script from exiting
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                if self._error is None:  # after a failure, skip the rest: drain reports the first
                    task.run()
                else:
                    task.skip(self._error)
            except BaseException as error:  # noqa: BLE001 - handed to the training thread by drain()
                self._error = error
            finally:
                task = None  # drop its closure while idle
                self._queue.task_done()

    @property
    def failed(self) -> bool:
        """A task raised: the rest are skipped until ``drain`` reports it."""
        return self._error is not None

    def submit(self, task: Callable[[], None]) -> Pending:
        if not self._thread.is_alive():
            raise RuntimeError("the update worker has stopped")
        pending = Pending(task, self._thread)
        self._queue.put(pending)
        return pending

    def drain(self) -> None:
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
