"""An inference worker's one thread for the work that must not hold its serving loop: merged exports
(minutes for a large model, on the CPU), evaluations' grading (a python grader's sandbox, an http
endpoint, a reward model) and the start of an evaluation (its file and checkpoints fetched). One piece
at a time, taken in turn between projects (``lane``: the project's id), so a project's hundred merges
hold another's evaluation behind one of them, not behind all. Each piece runs without gradients; its
result (or its error) is its ``Future``'s. A daemon thread: a worker told to stop does not wait for
it."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class Background:
    def __init__(self) -> None:
        self._lanes: dict[str, deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]] = {}
        self._turns: deque[str] = deque()  # lanes with work, the next one first
        self._ready = threading.Condition()
        self.running: str | None = None  # the lane of the piece under way
        threading.Thread(target=self._serve, name="serve-background", daemon=True).start()

    def submit(self, lane: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        done: Future[Any] = Future()
        with self._ready:
            if lane not in self._lanes:
                self._lanes[lane] = deque()
                self._turns.append(lane)
            self._lanes[lane].append((done, fn, args))
            self._ready.notify()
        return done

    @property
    def waiting(self) -> int:
        with self._ready:
            return sum(len(q) for q in self._lanes.values())

    def _next(self) -> tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]:
        with self._ready:
            while not self._turns:
                self._ready.wait()
            lane = self._turns.popleft()
            piece = self._lanes[lane].popleft()
            if self._lanes[lane]:
                self._turns.append(lane)  # its next piece after every other lane's
            else:
                del self._lanes[lane]
            self.running = lane
            return piece

    def _serve(self) -> None:
        import torch

        while True:
            done, fn, args = self._next()
            try:
                with torch.inference_mode():
                    done.set_result(fn(*args))
            except BaseException as exc:  # the piece's own error, for whoever waits on it
                done.set_exception(exc)
            finally:
                self.running = None
