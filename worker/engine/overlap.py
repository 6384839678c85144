"""Work a training step runs on a thread beside its own: scoring that waits on other processes.

A step's scores do not depend on its reference log-probs, nor these on the scores. Where the
grader spends its time waiting on other processes (``worker.engine.rewards.scoring.scored_elsewhere``: a python
grader's sandbox, an ``http`` endpoint, a remote reward model), the step scores on a thread while it
runs the reference forward, and waits for the scores only where the advantages need them. The
thread draws no random numbers and makes no collectives, so the step computes what it computes
without it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Started(Generic[T]):
    """``work`` begun: on a thread when ``beside`` (the caller goes on meanwhile), else done at once
    (raising what it raises). ``result()`` waits for its value (raising what the thread's work
    raised) and says how long it took."""

    def __init__(self, work: Callable[[], T], *, beside: bool) -> None:
        self._work = work
        self._value: T | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="score", daemon=True) if beside else None
        if self._thread is not None:
            self._thread.start()
        else:  # at once, raising what it raises
            t0 = time.perf_counter()
            self._value = work()
            self.seconds = time.perf_counter() - t0

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._value = self._work()
        except BaseException as exc:  # re-raised in the caller's thread by result()
            self._error = exc
        self.seconds = time.perf_counter() - t0

    def result(self) -> tuple[T, float]:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value, self.seconds  # type: ignore[return-value]
