"""Mover: the worker's transfers submitted off vLLM's forward thread, in the order they were asked.

    mover.submit(fn) -> int    queue ``fn`` (a save or a background load: the store's walk, pins,
                               slots and engine calls); returns its number at once; from any
                               thread (a reader hands its load's copies over)
    mover.wait(n, timeout)     block until task ``n`` (and every one before it) has been submitted:
                               its copies are queued on the device, not done
    mover.close()              run what is queued, then stop

What a save or a background load needs before the forward is an event on the compute stream (the
KV written, the blocks zeroed): the forward thread records it and hands the rest over, so a step
pays microseconds whatever the request's size. One thread keeps the device's queues in the order
vLLM asked: a preemption's wait for a request's saves (`wait`) and a finished request's release
see every save queued before them submitted. A task that raises is logged and counted by the
caller's own handler (every task catches what a tier or the device throws); the thread never dies.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Mover:
    """One daemon thread running the tasks it is given, in order. name: the thread's name."""

    def __init__(self, name: str = "kvtier-mover") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._asked = 0  # tasks submitted so far
        self._submit_lock = threading.Lock()  # numbers and queue order agree across submitters
        self._ran = 0  # tasks run so far (the mover thread's count)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> int:
        """Queue ``fn``; its number, for `wait`."""
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("Mover is closed")
            self._asked += 1
            self._queue.put((self._asked, fn))
            return self._asked

    def wait(self, n: int, timeout: float | None = None) -> bool:
        """Block until tasks 1..n have run; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._ran >= n, timeout)

    @property
    def asked(self) -> int:
        """The number of the latest task submitted."""
        return self._asked

    @property
    def idle(self) -> bool:
        """Every task submitted so far has run."""
        return self._ran >= self._asked

    def close(self, timeout: float | None = None) -> None:
        """Run every queued task, then stop the thread."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            n, fn = item
            try:
                fn()
            except Exception:  # a task's own handler counts it; the thread must outlive any task
                log.exception("kvtier: a transfer task failed")
            finally:
                with self._cv:
                    self._ran = n
                    self._cv.notify_all()
