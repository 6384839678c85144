"""Requests of Tinker training models, from the API to the worker that holds the model, and their
answers (futures), in Redis, under ``rloo:tinker:<queue>`` (``<p>`` below):

* ``<p>:model:<model>:requests``: the model's requests in the order they came (a list of JSON
  envelopes ``{id, kind, ...}``); a request's body, when it has one (a forward_backward's
  protobuf), waits beside it under ``<p>:payload:<id>``.
* ``<p>:model:<model>:taking``: the requests a worker took and has not finished (moved there from
  the queue, atomically), which the next holder fails as lost should that worker die;
  ``<p>:bell:<model>``: rung once a request, what a worker with nothing to do waits on.
* ``<p>:future:<id>``: the future (a hash): its project, model, status (``pending``, ``running``,
  ``done``, ``failed``, ``lost``: meant for a state a dead worker lost, answered 410), the worker
  running it, and once done its answer's content type and body.
  Futures expire an hour after their last change.
* ``<p>:ready:<id>``: one element pushed when the future is done, which a waiting
  ``retrieve_future`` pops (a long poll rather than a busy one).
* ``<p>:holder:<model>``: the worker holding the model (a lease of ``RLOO_TINKER_LEASE_SECONDS`` it
  renews while it runs); ``<p>:held:<model>``: when its holder last renewed it, kept until the holder
  lets it go cleanly (its state saved): found by the next holder, it says the last one died, and
  which queued requests were sent to the state it lost;
  ``<p>:wake:<model>``: set for a while after a worker was asked to take the model, so the API
  asks once; ``<p>:wanted``: the models with requests and no holder, which a worker holding
  others takes when it has room.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any


def prefix() -> str:
    """``rloo:tinker:<queue>``: deployments sharing one Redis (each its own RLOO_QUEUE and database)
    never see each other's models."""
    from service.core.settings import get_settings

    return f"rloo:tinker:{get_settings().queue}"


FUTURE_TTL = 3600
WAKE_SECONDS = 20


def lease_seconds() -> float:
    from service.core.settings import get_settings

    return float(get_settings().tinker_lease_seconds)


def redis_time(conn: Any) -> float:
    """Redis's clock: one clock for the API's and the workers' hosts."""
    seconds, micros = conn.time()
    return float(seconds) + float(micros) / 1e6


def new_request_id() -> str:
    return f"tkr-{secrets.token_hex(12)}"


def _requests(model_id: str) -> str:
    return f"{prefix()}:model:{model_id}:requests"


def _future(rid: str) -> str:
    return f"{prefix()}:future:{rid}"


def _payload(rid: str) -> str:
    return f"{prefix()}:payload:{rid}"


def holder_key(model_id: str) -> str:
    return f"{prefix()}:holder:{model_id}"


@dataclass(frozen=True)
class Future:
    """A future as the API reads it."""

    project: int
    model: str
    kind: str
    status: str
    worker: str
    content_type: str
    body: bytes


# The API's side (submit and needs_worker on a synchronous connection, read and wait on an asyncio one) ----
def submit(
    conn: Any, *, project: int, model_id: str, kind: str, fields: dict[str, Any], payload: bytes | None = None
) -> str:
    """Queue a request of ``model_id`` and create its future; returns the request's id."""
    rid = new_request_id()
    envelope = json.dumps({"id": rid, "kind": kind, "sent": redis_time(conn), **fields}, allow_nan=False)
    pipe = conn.pipeline()
    pipe.hset(_future(rid), mapping={"project": project, "model": model_id, "status": "pending", "kind": kind})
    pipe.expire(_future(rid), FUTURE_TTL)
    if payload is not None:
        pipe.set(_payload(rid), payload, ex=FUTURE_TTL)
    pipe.rpush(_requests(model_id), envelope)
    pipe.expire(_requests(model_id), FUTURE_TTL)
    pipe.rpush(_bell(model_id), 1)
    pipe.expire(_bell(model_id), FUTURE_TTL)
    pipe.execute()
    return rid


def open_future(conn: Any, *, project: int, kind: str) -> str:
    """A future answered elsewhere than by a training model's worker (a sample, by an inference
    worker through ``service.infra.inference_bus``); its id."""
    rid = new_request_id()
    conn.hset(_future(rid), mapping={"project": project, "model": "", "status": "pending", "kind": kind})
    conn.expire(_future(rid), FUTURE_TTL)
    return rid


_SETTLE = """
if redis.call('HGET', KEYS[1], 'status') ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'content_type', ARGV[2], 'body', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""


async def settle(conn: Any, rid: str, *, content_type: str, body: bytes, failed: bool = False) -> bool:
    """``finish`` from the API's side (an asyncio connection): a sample's answer once it came, or its
    cancellation. The first to settle a pending future wins (atomically: a Lua script); False when
    it was settled already."""
    status = "failed" if failed else "done"
    return bool(await conn.eval(_SETTLE, 1, _future(rid), status, content_type, body, FUTURE_TTL))


def needs_worker(conn: Any, model_id: str) -> bool:
    """True when no worker holds ``model_id`` and none was asked lately: the caller asks one (once
    per ``WAKE_SECONDS``). The model is marked wanted meanwhile, so that a worker holding other
    models takes it too when it has room."""
    if conn.exists(holder_key(model_id)):
        return False
    conn.sadd(f"{prefix()}:wanted", model_id)
    return bool(conn.set(f"{prefix()}:wake:{model_id}", 1, nx=True, ex=WAKE_SECONDS))


async def read(conn: Any, rid: str) -> Future | None:
    raw = await conn.hgetall(_future(rid))
    if not raw:
        return None
    got = {k.decode(): v for k, v in raw.items()}
    return Future(
        project=int(got.get("project", b"0")),
        model=got.get("model", b"").decode(),
        kind=got.get("kind", b"").decode(),
        status=got.get("status", b"").decode(),
        worker=got.get("worker", b"").decode(),
        content_type=got.get("content_type", b"").decode(),
        body=got.get("body", b""),
    )


async def wait(conn: Any, rid: str, seconds: float) -> None:
    """Up to ``seconds`` for the future to be done (returns at once when it is)."""
    if seconds > 0:
        await conn.blpop([f"{prefix()}:ready:{rid}"], timeout=seconds)


async def holder_alive(conn: Any, model_id: str, worker: str) -> bool:
    held = await conn.get(holder_key(model_id))
    return held is not None and held.decode() == worker


async def forget(conn: Any, rid: str) -> None:
    """The answer was read: it is no longer kept."""
    await conn.delete(_future(rid), _payload(rid), f"{prefix()}:ready:{rid}")


# The worker's side --------------------------------------------------------------------------------------
def _held(model_id: str) -> str:
    return f"{prefix()}:held:{model_id}"


@dataclass(frozen=True)
class Claim:
    """``held``: the lease was taken. ``lost_before``: the last holder died (or lost its lease); the
    requests sent before this time (Redis's clock) were sent to the state it lost."""

    held: bool
    lost_before: float | None = None


def claim(conn: Any, model_id: str, worker: str) -> Claim:
    """Hold ``model_id`` (a lease renewed with ``renew``); not held if another worker holds it."""
    if not conn.set(holder_key(model_id), worker, nx=True, ex=max(1, round(lease_seconds()))):
        return Claim(False)
    conn.srem(f"{prefix()}:wanted", model_id)
    last = conn.getset(_held(model_id), redis_time(conn))
    conn.expire(_held(model_id), FUTURE_TTL)
    # No one could know that the last holder was gone before its lease ran out.
    return Claim(True, float(last) + lease_seconds() if last is not None else None)


def wanted(conn: Any) -> list[str]:
    """The models waiting for a worker, as ``needs_worker`` marked them."""
    return sorted(m.decode() for m in conn.smembers(f"{prefix()}:wanted"))


_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif not holder and redis.call('GET', KEYS[2]) == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else
  return 0
end
local t = redis.call('TIME')
local now = tostring(t[1] + t[2] / 1e6)
redis.call('SET', KEYS[2], now, 'EX', ARGV[4])
return now
"""


def renew(conn: Any, model_id: str, worker: str, last: str | None) -> str | None:
    """Renew the lease (atomically: a Lua script); ``last``: what the previous renewal answered.
    A lease that lapsed while no one else took it (the ``held`` mark is still this holder's last)
    is taken back. Returns the mark to pass next time; None when the lease was lost to another."""
    ms = max(1000, round(1000 * lease_seconds()))
    keys = [holder_key(model_id), _held(model_id)]
    answer = conn.eval(_RENEW, 2, *keys, worker, ms, last or "", FUTURE_TTL)
    return answer.decode() if isinstance(answer, bytes) else None


def release(conn: Any, model_id: str, worker: str, *, clean: bool) -> None:
    """Let the model go; ``clean``: its state was saved, so the next holder has nothing to report lost."""
    if conn.get(holder_key(model_id)) == worker.encode():
        if clean:
            conn.delete(_held(model_id))
        conn.delete(holder_key(model_id))


_TAKE = """
for i, key in ipairs(KEYS) do
  if i % 2 == 1 then
    local moved = redis.call('LMOVE', key, KEYS[i + 1], 'LEFT', 'RIGHT')
    if moved then return {key, moved} end
  end
end
return false
"""


def _taking(model_id: str) -> str:
    return f"{prefix()}:model:{model_id}:taking"


def _bell(model_id: str) -> str:
    return f"{prefix()}:bell:{model_id}"


def take(
    conn: Any, model_ids: list[str], worker: str, *, block: float
) -> tuple[str, dict[str, Any], bytes | None] | None:
    """The next request of any of ``model_ids`` (each model's in the order they came; the first
    model first), its model and its body, marked running by ``worker``; None after ``block``
    seconds without one. A request is moved, not popped, to the model's ``taking`` list until it is
    finished: one taken by a worker that died before finishing it is found there by the next holder
    (``take_lost``). A worker waits on each model's bell, which ``submit`` rings."""
    for attempt in range(2):
        keys = [k for m in model_ids for k in (_requests(m), _taking(m))]
        found = conn.eval(_TAKE, len(keys), *keys)
        if found:
            model_id = found[0].decode()[len(f"{prefix()}:model:") : -len(":requests")]
            envelope: dict[str, Any] = json.loads(found[1])
            envelope["_raw"] = found[1].decode()
            started = {"status": "running", "worker": worker, "started": time.time()}
            conn.hset(_future(envelope["id"]), mapping=started)
            return model_id, envelope, conn.get(_payload(envelope["id"]))
        if attempt == 0 and conn.blpop([_bell(m) for m in model_ids], timeout=block) is None:
            return None
    return None


def take_lost(conn: Any, model_id: str, before: float | None) -> list[dict[str, Any]]:
    """Requests of ``model_id`` meant for a state a dead worker lost, taken off its lists: those it
    had taken and not finished, and (``before`` set) those queued that were sent before ``before``."""
    lost = [json.loads(raw) for raw in conn.lrange(_taking(model_id), 0, -1)]
    conn.delete(_taking(model_id))
    while before is not None and (head := conn.lindex(_requests(model_id), 0)) is not None:
        envelope: dict[str, Any] = json.loads(head)
        if float(envelope.get("sent", 0)) >= before or conn.lpop(_requests(model_id)) != head:
            break
        lost.append(envelope)
    return lost


def pending(conn: Any, model_id: str) -> int:
    return int(conn.llen(_requests(model_id)))


def finish(
    conn: Any,
    rid: str,
    *,
    content_type: str,
    body: bytes,
    failed: bool = False,
    lost: bool = False,
    taken: tuple[str, str] | None = None,
) -> None:
    """Store the answer (a JSON or protobuf body) and wake whoever waits for it. ``lost``: a request
    sent to a state a dead worker lost, answered 410 (the SDK's retryable error). ``taken``: the
    model and the envelope ``take`` moved to its ``taking`` list, removed from it."""
    pipe = conn.pipeline()
    if taken is not None:
        pipe.lrem(_taking(taken[0]), 1, taken[1])
    status = "lost" if lost else "failed" if failed else "done"
    pipe.hset(_future(rid), mapping={"status": status, "content_type": content_type, "body": body})
    pipe.expire(_future(rid), FUTURE_TTL)
    pipe.delete(_payload(rid))
    pipe.rpush(f"{prefix()}:ready:{rid}", 1)
    pipe.expire(f"{prefix()}:ready:{rid}", FUTURE_TTL)
    pipe.execute()
