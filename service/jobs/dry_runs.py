"""Dry runs of graders (``POST /v1/fine_tuning/alpha/graders/run``): admitted per project, queued
fairly between projects, graded on a worker of the graders queue, answered within a deadline.

The API never grades: a reward model, a python grader in its sandbox, a long ROUGE-L, all run in a
worker process (``rloo worker --queue <queue>-graders``), so no dry run can starve the API's event
loop or its threads. In Redis, beside the Celery queue:

* ``active:<project>``: the project's dry runs in flight (a sorted set by deadline). A project has
  at most ``RLOO_MAX_DRY_RUNS`` at once; past that a 429 names the cap. An entry leaves when its
  dry run is answered, or withdrawn before a worker took it (the API stopped waiting); one that a
  worker took stays until that worker answers, however long the API waited; and any entry leaves
  at its deadline (the API process or the worker died).
* ``pending:<project>``: the project's waiting dry runs, as JSON. The Celery message is only a
  wake-up with no arguments: user data never goes through Celery's pool pickling, and a message
  that cannot be decoded carries nothing to lose.
* ``projects``: the projects with work waiting, by when each was last served. A worker takes the
  first dry run of the project served longest ago: one project's twenty dry runs wait behind
  another's one, not the reverse.
* ``grading:<project>``: the project's dry runs being graded. A project has at most half the graders
  worker's processes (``share``) at once, so another project's dry run finds one free however long the
  first's graders take; a wake-up that finds only such projects waiting takes nothing, and the worker
  that answers one of theirs sends a wake-up for what still waits.
* ``inflight:<task id>``: the dry run a worker is grading. Should the worker process die on it
  (the out-of-memory killer, a crash), Celery delivers the wake-up again and the next delivery
  finds this marker: that dry run is answered with an error and set aside in ``dead`` (the last
  1000), never graded again. A poison dry run costs one worker process, once.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from typing import Any

import anyio

from service.core.settings import get_settings

DEAD_LETTERS_KEPT = 1000

# Admit one dry run unless the project has `cap` in flight (entries past their deadline dropped).
_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
local keep = math.ceil(tonumber(ARGV[2]) - tonumber(ARGV[1])) + 60
if redis.call('TTL', KEYS[1]) < keep then redis.call('EXPIRE', KEYS[1], keep) end  -- never shorter
return 1
"""
# Queue a dry run; a project new to the rotation keeps the place its last service gave it.
_PUSH = """
redis.call('RPUSH', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], 3600)
local served = redis.call('HGET', KEYS[3], ARGV[1]) or '0'
redis.call('ZADD', KEYS[2], 'NX', served, ARGV[1])
return 1
"""
# The next dry run: from the project served longest ago that has fewer than ARGV[3] being graded
# (`grading:<project>`, by when each is done at the latest); none when every waiting project has.
# The dry run taken joins `grading:<project>` in the same script (until ARGV[1] + ARGV[5]), so two
# processes taking at once never both see the project under its share.
_POP = """
for _, project in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local grading = ARGV[4] .. project
  redis.call('ZREMRANGEBYSCORE', grading, '-inf', ARGV[1])
  if redis.call('ZCARD', grading) < tonumber(ARGV[3]) then
    local pending = ARGV[2] .. project
    local envelope = redis.call('LPOP', pending)
    if redis.call('LLEN', pending) == 0 then
      redis.call('ZREM', KEYS[1], project)
    else
      redis.call('ZADD', KEYS[1], ARGV[1], project)
    end
    redis.call('HSET', KEYS[2], project, ARGV[1])
    if envelope then
      redis.call('ZADD', grading, tonumber(ARGV[1]) + tonumber(ARGV[5]), cjson.decode(envelope)['id'])
      redis.call('EXPIRE', grading, math.ceil(tonumber(ARGV[5])) + 60)
      return envelope
    end
  end
end
return false
"""


def share(concurrency: int) -> int:
    """Dry runs one project's are graded at once on a graders worker of ``concurrency`` processes:
    half of them (at least one), so that another project's dry run finds a process free however long
    the first project's graders take (a trickling http endpoint held both processes)."""
    return max(1, concurrency // 2)


class Busy(Exception):
    """The project has its cap of dry runs in flight."""


class NoAnswer(TimeoutError):
    pass


def namespace(queue: str) -> str:
    return f"rloo:dry-runs:{queue}"


async def run(*, project: str, payload: dict[str, Any], queue: str, timeout: float, cap: int) -> dict[str, Any]:
    """Admit, queue and wait for one dry run; its answer (``{"error", "code", "status"}`` when the
    grader could not run). Raises ``Busy``, ``NoAnswer``, or the broker's error."""
    import redis.asyncio

    ns = namespace(queue)
    run_id = secrets.token_hex(12)
    now = time.time()
    deadline = now + timeout
    active = f"{ns}:active:{project}"
    conn = redis.asyncio.Redis.from_url(
        get_settings().redis_client_url, socket_timeout=timeout + 5, socket_connect_timeout=5
    )
    try:
        if not await conn.eval(_ADMIT, 1, active, now, deadline, run_id, cap):
            raise Busy()
        # Held by a worker that took it and has not answered: the place stays taken until it does.
        state = {"held": False}
        try:
            return await _queue_and_wait(conn, ns, queue, run_id, project, payload, deadline, timeout, state)
        finally:
            if not state["held"]:
                with contextlib.suppress(Exception), anyio.CancelScope(shield=True):
                    await conn.zrem(active, run_id)
    finally:
        await conn.aclose()


async def _queue_and_wait(
    conn: Any,
    ns: str,
    queue: str,
    run_id: str,
    project: str,
    payload: dict[str, Any],
    deadline: float,
    timeout: float,
    state: dict[str, bool],
) -> dict[str, Any]:
    from service.infra import task_queue as celery_queue

    reply = f"{ns}:reply:{run_id}"
    envelope = json.dumps(
        {"id": run_id, "project": project, "deadline": deadline, "reply": reply, "payload": payload},
        ensure_ascii=False,
        allow_nan=False,
    )
    pending = f"{ns}:pending:{project}"
    await conn.eval(_PUSH, 3, pending, f"{ns}:projects", f"{ns}:served", project, envelope)
    answer = None
    try:
        await anyio.to_thread.run_sync(celery_queue.wake_grader, queue, timeout)
        answer = await conn.blpop([reply], timeout=max(1, int(timeout)))
    finally:
        # Not answered (no worker came, the broker failed, the client went away): take it back
        # unless a worker holds it already. Shielded: a client that went away cancels this request.
        with anyio.CancelScope(shield=True):
            state["held"] = answer is None and not await conn.lrem(pending, 1, envelope)
    if answer is None:
        raise NoAnswer(
            f"no worker answered on queue '{queue}' within {timeout:g} s; graders run on a worker started with "
            f"`rloo worker --queue {queue}` (rloo up starts one)"
        )
    result: dict[str, Any] = json.loads(answer[1])
    return result


# The worker's side -------------------------------------------------------------------------------
def take(conn: Any, queue: str, task_id: str) -> dict[str, Any] | None:
    """The next dry run for this delivery of a wake-up, or None (its dry run was answered already,
    or is past its deadline). A dry run left in flight by an earlier delivery of the same wake-up
    (its worker died) is dead-lettered first."""
    ns = namespace(queue)
    marker = f"{ns}:inflight:{task_id}"
    left = conn.get(marker)
    if left is not None:
        bury(conn, queue, left.decode() if isinstance(left, bytes) else left)
        conn.delete(marker)
    settings = get_settings()
    hold = settings.grader_run_seconds + 60  # a place taken while graded, up to this worker's hard limit
    while True:
        raw = conn.eval(
            _POP,
            2,
            f"{ns}:projects",
            f"{ns}:served",
            time.time(),
            f"{ns}:pending:",
            share(settings.grader_concurrency),
            f"{ns}:grading:",
            hold,
        )
        if raw is None:
            return None
        envelope: dict[str, Any] = json.loads(raw)
        project = envelope["project"]
        if envelope["deadline"] <= time.time():  # the API stopped waiting: dropped, its place let go
            conn.zrem(f"{ns}:grading:{project}", envelope["id"])
            continue
        conn.set(marker, raw, ex=max(1, int(envelope["deadline"] - time.time()) + 60))
        # The project's place among its dry runs in flight stays taken while this is graded.
        active = f"{ns}:active:{project}"
        if conn.zadd(active, {envelope["id"]: time.time() + hold}, xx=True, ch=True) and conn.ttl(active) < hold:
            conn.expire(active, int(hold) + 60)
        return envelope


def answer(conn: Any, queue: str, task_id: str, envelope: dict[str, Any], result: dict[str, Any]) -> bool:
    """The dry run's answer where the API waits, its places let go. True when other dry runs wait
    (one a project's share kept back may have no wake-up left: the caller sends one)."""
    ns = namespace(queue)
    conn.rpush(envelope["reply"], json.dumps(result, ensure_ascii=False, allow_nan=False))
    conn.expire(envelope["reply"], 300)  # nobody waits past the API's time-out; the key must not linger
    conn.zrem(f"{ns}:active:{envelope['project']}", envelope["id"])
    conn.zrem(f"{ns}:grading:{envelope['project']}", envelope["id"])
    conn.delete(f"{ns}:inflight:{task_id}")
    return bool(conn.zcard(f"{ns}:projects"))


def bury(conn: Any, queue: str, raw: str) -> None:
    """Set a dry run that ended its worker process aside, and tell the API so."""
    ns = namespace(queue)
    conn.lpush(f"{ns}:dead", raw)
    conn.ltrim(f"{ns}:dead", 0, DEAD_LETTERS_KEPT - 1)
    try:
        envelope = json.loads(raw)
    except ValueError:
        return
    conn.zrem(f"{ns}:active:{envelope['project']}", envelope["id"])
    conn.zrem(f"{ns}:grading:{envelope['project']}", envelope["id"])
    error = {
        "error": "the grader ended the worker process that ran it (killed, or out of memory); it was set "
        "aside and will not be run again",
        "code": "grader_crashed",
        "status": 502,
    }
    conn.rpush(envelope["reply"], json.dumps(error))
    conn.expire(envelope["reply"], 300)
