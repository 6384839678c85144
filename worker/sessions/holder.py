"""A training worker holding Tinker training models: the ``rloo.hold_tinker_model`` task.

The API asks for it when a request arrives for a model no worker holds (``service.tinker.bus``).
The task takes the model's lease and builds it (from its newest saved state, when it has one),
then serves the requests of every model it holds, each model's in the order they came, each
answer stored as its future's. While it serves, it takes other models that wait for a worker, up
to ``RLOO_TINKER_MODELS_PER_WORKER`` (several sessions, of any projects, on one process). A model
with no request for ``RLOO_TINKER_IDLE_SECONDS`` has its state saved (weights, optimizer) and
recorded on its row, and is let go; the task ends with its last model, and the device goes back
to the queue's jobs. A model's next request brings it back, here or on another worker, from that
state. A worker that dies loses what was not saved: the running request's future answers 410
(the SDK's retryable error), and so do the requests sent to the model before its lease ran out
(the next holder fails them when it takes the model); the model comes back from its last saved
state, and requests sent after run on it.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

from celery.signals import worker_shutting_down

from service.core.settings import get_settings
from service.infra import task_queue
from service.infra.task_queue import HOLD_TINKER_MODEL_TASK
from service.tinker import bus
from worker.celery_app import app
from worker.sessions.requests import Failure, Holder

log = logging.getLogger("rloo.tinker")


@app.task(name=HOLD_TINKER_MODEL_TASK, Request="worker.jobs.message_guard:TinkerModelRequest")
def hold_tinker_model(model_id: str) -> str:
    """Hold ``model_id`` (and the models that come to wait meanwhile) until they idle, serving their
    requests; "held elsewhere" when another worker has it."""
    import redis

    from service.core.identity import process_name

    settings = get_settings()
    conn = redis.Redis.from_url(settings.redis_client_url, socket_timeout=30, socket_connect_timeout=5)
    models = Models(conn, process_name(), most=settings.tinker_models_per_worker, idle=settings.tinker_idle_seconds)
    if not models.adopt(model_id):
        return "held elsewhere"
    turn = Turn(conn, settings.tinker_turn_seconds)
    try:
        models.serve(until=lambda: _worker_stopping(conn) or turn.over())
    finally:
        waiting = models.let_go_of_all(save=True)  # stopped (or failed): what it had learned is kept
    if turn.ended:  # a job's turn: the models with requests come back after it, from the queue
        for waiting_model in waiting:
            task_queue.wake_tinker_model(waiting_model)
        return "yielded to a waiting job"
    return "released"


class Leases:
    """The leases of the models a holder holds, renewed by a thread of their own every third of a
    lease, so that a long request, a model's load or a save never lets one lapse."""

    def __init__(self, worker: str) -> None:
        import threading

        import redis

        self.worker = worker
        self.conn = redis.Redis.from_url(get_settings().redis_client_url, socket_timeout=10, socket_connect_timeout=5)
        self.marks: dict[str, str | None] = {}
        self.gone: set[str] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._renew_forever, name="tinker-leases", daemon=True).start()

    def add(self, model_id: str) -> None:
        with self.lock:
            self.marks[model_id] = None
            self.gone.discard(model_id)
        self._renew_once()

    def drop(self, model_id: str) -> None:
        with self.lock:
            self.marks.pop(model_id, None)

    def lost(self) -> list[str]:
        with self.lock:
            gone, self.gone = sorted(self.gone), set()
        return gone

    def _renew_once(self) -> None:
        with self.lock:
            marks = dict(self.marks)
        for model_id, last in marks.items():
            try:
                mark = bus.renew(self.conn, model_id, self.worker, last)
            except Exception as exc:  # Redis away a moment: the next round tries again
                log.warning("tinker model %s: lease not renewed: %s", model_id, exc)
                continue
            with self.lock:
                if model_id not in self.marks:
                    continue
                if mark is None:
                    self.marks.pop(model_id, None)
                    self.gone.add(model_id)
                else:
                    self.marks[model_id] = mark

    def _renew_forever(self) -> None:
        while True:
            time.sleep(bus.lease_seconds() / 3)
            self._renew_once()


def _stopping_key(worker_pid: int) -> str:
    import socket

    return f"{bus.prefix()}:stopping:{socket.gethostname()}:{worker_pid}"


@worker_shutting_down.connect
def _say_the_worker_stops(**_: object) -> None:
    """The worker's main process is told to stop (SIGTERM to it alone: ``docker stop``, systemd): a
    warm shutdown waits for the running task, and a holder would serve on until its models idle. The
    mark tells its pool process to save its models and let them go now."""
    import os

    import redis

    try:
        conn = redis.Redis.from_url(get_settings().redis_client_url, socket_timeout=5, socket_connect_timeout=5)
        conn.set(_stopping_key(os.getpid()), 1, ex=3600)
    except Exception as exc:  # the holder then ends with its models' idle time, as before
        log.warning("could not tell the tinker holder to stop: %s", exc)


def _worker_stopping(conn: Any) -> bool:
    import os

    return bool(conn.exists(_stopping_key(os.getppid())))


class Turn:
    """A holder's turn on its worker: over once it has held for ``seconds`` while a fine-tuning job
    waits in the worker's queues (checked every ``CHECK_SECONDS``), so that sessions never starve
    queued jobs; the job's task is ahead of the models' next wake in the queue, and the reverse holds
    as well (a job never starves a session: the session's wake waits behind it, not behind all)."""

    CHECK_SECONDS = 10.0

    def __init__(self, conn: Any, seconds: float) -> None:
        import os

        self.conn, self.seconds, self.ended = conn, seconds, False
        self.queues = [q for q in os.environ.get(task_queue.WORKER_QUEUES_VARIABLE, "").split(",") if q] or [
            get_settings().queue
        ]
        self.started = self.checked = time.monotonic()

    def over(self) -> bool:
        now = time.monotonic()
        if now - self.started < self.seconds or now - self.checked < self.CHECK_SECONDS:
            return False
        self.checked = now
        try:
            self.ended = task_queue.jobs_waiting(self.conn, self.queues)
        except Exception as exc:  # the broker away: serve on
            log.warning("could not look for waiting jobs: %s", exc)
        if self.ended:
            log.info("a fine-tuning job waits: letting the tinker models go for its turn")
        return self.ended


class Models:
    """The models this process holds, by id, and when each was last asked for something."""

    def __init__(self, conn: Any, worker: str, *, most: int, idle: float) -> None:
        self.conn, self.worker, self.most, self.idle = conn, worker, most, idle
        self.held: dict[str, Holder] = {}
        self.used: dict[str, float] = {}
        self.leases = Leases(worker)

    def adopt(self, model_id: str) -> bool:
        """Take ``model_id``'s lease and build it; False if another worker holds it or it cannot be
        built (its waiting requests then say why)."""
        claim = bus.claim(self.conn, model_id, self.worker)
        if not claim.held:
            return False
        self.leases.add(model_id)  # renewed from now on, through a long load or request too
        try:
            self.held[model_id] = holder = Holder.start(model_id)
        except Exception as exc:
            self._fail_waiting(model_id, Failure.of(exc))
            self.leases.drop(model_id)
            bus.release(self.conn, model_id, self.worker, clean=False)
            return False
        self.used[model_id] = time.monotonic()
        log.info("holding tinker model %s (%d held)", model_id, len(self.held))
        self._fail_lost(holder, claim.lost_before)
        return True

    def _fail_lost(self, holder: Holder, before: float | None) -> None:
        """The last worker holding the model died (``before`` set): the requests it had taken and
        those sent to the state it lost (before anyone could know) fail with the SDK's retryable
        error; later ones run on the state restored."""
        lost = bus.take_lost(self.conn, holder.model_id, before)
        if not lost:
            return
        body = Failure(holder.restored_from(), "server").body()
        log.warning("tinker model %s: its last worker died; %d requests sent to it fail", holder.model_id, len(lost))
        for envelope in lost:
            bus.finish(self.conn, envelope["id"], content_type="application/json", body=body, failed=True, lost=True)

    def serve(self, until: Any = lambda: False) -> None:
        """Requests of the held models, one at a time, until none is held or ``until()``."""
        while self.held and not until():
            self._renew()
            for model_id in bus.wanted(self.conn)[: max(0, self.most - len(self.held))]:
                self.adopt(model_id)
            order = sorted(self.used, key=self.used.__getitem__)  # the longest unserved first: turns
            taken = bus.take(self.conn, order, self.worker, block=1.0) if self.held else None
            if taken is not None:
                model_id, envelope, payload = taken
                self._answer(self.held[model_id], envelope, payload)
                self.used[model_id] = time.monotonic()
            self._let_go_of_idle()

    def _renew(self) -> None:
        for model_id in self.leases.lost():
            if model_id in self.held:
                log.warning("tinker model %s: lease lost to another worker; letting it go unsaved", model_id)
                self._forget(model_id)

    def _let_go_of_idle(self) -> None:
        now = time.monotonic()
        for model_id in [m for m, t in self.used.items() if now - t >= self.idle]:
            if not bus.pending(self.conn, model_id):
                self._let_go(model_id, save=True)

    def _let_go(self, model_id: str, *, save: bool) -> None:
        saved = False
        try:
            if save:
                self.held[model_id].save_resume_state()
                saved = True
        except Exception:
            log.error("tinker model %s: its state could not be saved\n%s", model_id, traceback.format_exc())
        finally:
            bus.release(self.conn, model_id, self.worker, clean=saved)
            self._forget(model_id)
            log.info("let go of tinker model %s (%d held)", model_id, len(self.held))

    def let_go_of_all(self, *, save: bool) -> list[str]:
        """Every model let go; those with requests waiting."""
        waiting = [m for m in self.held if bus.pending(self.conn, m)]
        for model_id in list(self.held):
            self._let_go(model_id, save=save)
        return waiting

    def _forget(self, model_id: str) -> None:
        self.leases.drop(model_id)
        self.held.pop(model_id, None)
        self.used.pop(model_id, None)

    def _answer(self, holder: Holder, envelope: dict[str, Any], payload: bytes | None) -> None:
        rid, taken = envelope["id"], (holder.model_id, envelope.pop("_raw"))
        try:
            content_type, body = holder.run(envelope, payload)
        except Exception as exc:
            failure = Failure.of(exc)
            if failure.category == "server":
                log.error(
                    "tinker model %s: %s failed\n%s", holder.model_id, envelope.get("kind"), traceback.format_exc()
                )
            bus.finish(self.conn, rid, content_type="application/json", body=failure.body(), failed=True, taken=taken)
            return
        bus.finish(self.conn, rid, content_type=content_type, body=body, taken=taken)

    def _fail_waiting(self, model_id: str, failure: Failure) -> None:
        log.error("tinker model %s could not be built: %s", model_id, failure.message)
        while (taken := bus.take(self.conn, [model_id], self.worker, block=0.01)) is not None:
            raw = (model_id, taken[1].pop("_raw"))
            bus.finish(
                self.conn, taken[1]["id"], content_type="application/json", body=failure.body(), failed=True, taken=raw
            )
