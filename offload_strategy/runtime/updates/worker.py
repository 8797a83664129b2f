"""One background thread that runs unit updates in the order they are submitted."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Optional


class UpdateWorker:
    """Runs submitted callables one at a time on its own thread; ``drain`` waits for all of them
    and re-raises the first exception any of them raised."""

    def __init__(self, name: str = "offload-update") -> None:
        self._queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)  # never keeps a script from exiting
        self._thread.start()

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                if self._error is None:  # after a failure, skip the rest: drain reports the first
                    task()
            except BaseException as error:  # noqa: BLE001 - handed to the training thread by drain()
                self._error = error
            finally:
                self._queue.task_done()

    @property
    def failed(self) -> bool:
        """A task raised: the rest are skipped until ``drain`` reports it."""
        return self._error is not None

    def submit(self, task: Callable[[], None]) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the update worker has stopped")
        self._queue.put(task)

    def drain(self) -> None:
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
