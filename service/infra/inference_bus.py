"""Inference requests between the API and the inference workers (``rloo worker --serve``), in Redis.

The API never samples: it checks a request, resolves its model to directories (``service.registry.weights``),
admits it against the key's limits, and queues it; an inference worker takes it, batches it with
others for the same base model, and pushes what it writes back token by token. In Redis, under
``rloo:inference:<queue>``:

* ``pending:<project>:<key>``: the requests waiting, as JSON, a list for each project and key;
  ``lanes:<project>``, that project's keys with requests waiting, and ``projects``, the projects with
  any, each scored by its last turn (``turns`` counts them; ``…:served`` keeps each lane's last turn
  for its next return). A worker takes the next request from the key served longest ago of the
  project served longest ago: one project's many requests (or one key's) wait behind another's one,
  not the reverse. ``ready`` holds a token a waiting request, for a worker
  to block on. Celery is not in this path: a worker takes many requests at once into one batch,
  which a task per request cannot.
* ``reply:<id>``: what the worker wrote for a request, one JSON message an item: ``start`` (the
  prompt's token count), ``delta`` (new text of choice ``i``), ``end`` (choice ``i`` finished), then
  ``done`` (with the usage); or a single ``error`` (``status``, ``code``, ``message``, ``param``).
* ``lease:<id>``: which worker holds a request, refreshed every ``LEASE_REFRESH`` seconds while it
  does. A request the API waits on whose lease has gone without a ``done`` lost its worker: 503.
* ``inflight:<worker>``: the requests a worker holds; its supervisor answers them 503 at once when
  the worker process dies, and starts another.
* ``cancel:<id>``: the client went away: the worker drops the request's rows at its next token.
* ``workers``: live workers, scored by when their heartbeat expires. No live worker: 503 at once.
  ``warm``: those of them that have loaded the models they preload (``RLOO_INFERENCE_PRELOAD``);
  ``rloo up`` waits for one before it says it is up.
* ``active:<key>``: a key's requests in flight, scored by deadline, each holding its token budget
  (its prompts' tokens, estimated from their bytes, and ``max_tokens``, times ``n``). Past
  ``RLOO_INFERENCE_MAX_CONCURRENT`` requests or ``RLOO_INFERENCE_MAX_TOKENS_IN_FLIGHT`` tokens a key
  is answered 429; an entry leaves when its request ends, whichever way, or at its deadline.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from service.core import errors

LEASE_SECONDS = 10
BYTES_PER_TOKEN = 4
"""A prompt's tokens, as the per-key budget estimates them from its UTF-8 bytes (the API tokenizes
nothing): about what English text takes."""
MAX_BYTES_PER_TOKEN = 32
"""No token of any tokenizer we serve spans more bytes than this (a run of spaces is the longest), so a
prompt of more than ``context`` times this many bytes cannot fit the context: refused untokenized."""


def rows_a_project(max_batch: int) -> int:
    """Rows of a worker's batch (``RLOO_INFERENCE_MAX_BATCH``) one project's requests may hold, and so
    the most completions one request may ask for: three quarters, the rest kept for other projects'
    requests to join a batch under way at its next token (none kept below 4 rows)."""
    return max_batch - max_batch // 4


def past_any_context(context: int | None, size: int, param: str) -> str | None:
    """Why a prompt of ``size`` UTF-8 bytes cannot fit a context of ``context`` tokens, counted or
    not (None: it may): the message of a 400 ``context_length_exceeded`` naming ``param``."""
    if context is None or size <= context * MAX_BYTES_PER_TOKEN:
        return None
    return (
        f"This model's maximum context length is {context} tokens. However, your {param} is {size} bytes, more "
        f"than {context} tokens of text can hold (at most {MAX_BYTES_PER_TOKEN} bytes a token). Shorten the {param}."
    )


def estimated_tokens(size: int) -> int:
    """The tokens of a text of ``size`` UTF-8 bytes as the budget counts them, and a few for the
    template around it."""
    return -(-size // BYTES_PER_TOKEN) + 8


LEASE_REFRESH = 2.0
READ_AT_ONCE = 256  # reply messages the API takes in one round trip

# Admit a request unless the key has `cap` in flight or their token budgets would pass `tokens_cap`.
# Members are "<id>:<tokens>"; entries past their deadline are dropped first.
_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
if #members >= tonumber(ARGV[4]) then return 1 end
local tokens = tonumber(ARGV[5])
for _, m in ipairs(members) do tokens = tokens + tonumber(string.match(m, ':(%d+)$')) end
if tokens > tonumber(ARGV[6]) then return 2 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) - tonumber(ARGV[1])) + 60)
return 0
"""


# Queue a request in its project's and key's lane. A lane new to the rotation keeps the place its
# last turn gave it (0: never served): a project that is seldom served goes before one served a
# moment ago, however long that one's queue.
_PUSH = """
redis.call('RPUSH', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[1], 3600)
redis.call('ZADD', KEYS[2], 'NX', redis.call('HGET', KEYS[2] .. ':served', ARGV[2]) or 0, ARGV[2])
redis.call('EXPIRE', KEYS[2], 3600)
redis.call('ZADD', KEYS[3], 'NX', redis.call('HGET', KEYS[3] .. ':served', ARGV[1]) or 0, ARGV[1])
redis.call('RPUSH', KEYS[4], 1)
redis.call('EXPIRE', KEYS[4], 3600)
return 1
"""
# Up to ARGV[2] requests, each from the key served longest ago of the project served longest ago
# (each turn a number from `turns`, kept in `<zset>:served` for the lane's next return); one `ready`
# token taken for each (ARGV[3] of them were taken already, by the caller's BLPOP).
_POP = """
local out, spare = {}, tonumber(ARGV[3])
while #out < tonumber(ARGV[2]) do
  local project = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not project then break end
  local lanes = ARGV[1] .. ':lanes:' .. project
  local key = redis.call('ZRANGE', lanes, 0, 0)[1]
  local envelope = false
  if key then
    local pending = ARGV[1] .. ':pending:' .. project .. ':' .. key
    envelope = redis.call('LPOP', pending)
    local turn = redis.call('INCR', KEYS[3])
    redis.call('HSET', lanes .. ':served', key, turn)
    redis.call('EXPIRE', lanes .. ':served', 86400)
    if redis.call('LLEN', pending) == 0 then
      redis.call('ZREM', lanes, key)
    else
      redis.call('ZADD', lanes, turn, key)
    end
  end
  local turn = redis.call('INCR', KEYS[3])
  redis.call('HSET', KEYS[1] .. ':served', project, turn)
  redis.call('EXPIRE', KEYS[1] .. ':served', 86400)
  if redis.call('ZCARD', lanes) == 0 then
    redis.call('ZREM', KEYS[1], project)
  else
    redis.call('ZADD', KEYS[1], turn, project)
  end
  if envelope then
    out[#out + 1] = envelope
    if spare > 0 then spare = spare - 1 else redis.call('LPOP', KEYS[2]) end
  end
end
return out
"""
SYSTEM_LANE = "_"
"""The lane of requests that are no project's (a training job's remote reward model batches)."""


class Refused(Exception):
    """The key is at one of its limits: ``what`` says which."""

    def __init__(self, what: str) -> None:
        self.what = what


class NoWorker(Exception):
    pass


class WorkerLost(Exception):
    pass


class Unreachable(Exception):
    """Redis, which carries the bus, did not answer (``ask``'s callers need no Redis of their own)."""


class TimedOut(Exception):
    pass


class ClientGone(Exception):
    """The client that waits for the request went away."""


def namespace(queue: str) -> str:
    return f"rloo:inference:{queue}"


def serve_queue() -> str:
    """The queue the inference workers serve: ``RLOO_SERVE_QUEUE``, or ``<queue>-serve``."""
    from service.core.settings import get_settings

    settings = get_settings()
    return settings.serve_queue or f"{settings.queue}-serve"


def connect_async() -> Any:
    import redis.asyncio

    from service.core.settings import get_settings

    return redis.asyncio.Redis.from_url(get_settings().redis_client_url, socket_timeout=30, socket_connect_timeout=5)


def live_workers(conn: Any, ns: str, *, warm: bool = False) -> int:
    """How many workers of ``ns`` beat lately (``warm``: and have loaded what they preload); a
    synchronous connection."""
    return int(conn.zcount(f"{ns}:{'warm' if warm else 'workers'}", time.time(), "+inf"))


# The API's side --------------------------------------------------------------------------------------
async def admit(
    conn: Any, ns: str, *, key: str, rid: str, tokens: int, deadline: float, cap: int, token_cap: int
) -> None:
    if not await conn.zcount(f"{ns}:workers", time.time(), "+inf"):
        raise NoWorker()
    refused = await conn.eval(
        _ADMIT, 1, f"{ns}:active:{key}", time.time(), deadline, f"{rid}:{tokens}", cap, tokens, token_cap
    )
    if refused:
        raise Refused("requests" if refused == 1 else "tokens")


async def release(conn: Any, ns: str, *, key: str, rid: str, tokens: int) -> None:
    await conn.zrem(f"{ns}:active:{key}", f"{rid}:{tokens}")


def _push_args(ns: str, envelope: dict[str, Any]) -> tuple[Any, ...]:
    """The arguments of ``_PUSH`` for ``envelope``, in its project's and key's lane."""
    project, key = str(envelope.get("project") or SYSTEM_LANE), str(envelope.get("key") or SYSTEM_LANE)
    body = json.dumps(envelope, ensure_ascii=False, allow_nan=False)
    keys = (f"{ns}:pending:{project}:{key}", f"{ns}:lanes:{project}", f"{ns}:projects", f"{ns}:ready")
    return (_PUSH, len(keys), *keys, project, key, body)


async def submit(conn: Any, ns: str, envelope: dict[str, Any]) -> None:
    """Queue ``envelope`` (its ``project`` and ``key`` name its lane) for the inference workers."""
    await conn.eval(*_push_args(ns, envelope))


def submit_sync(conn: Any, ns: str, envelope: dict[str, Any]) -> None:
    """``submit`` on a synchronous connection."""
    conn.eval(*_push_args(ns, envelope))


async def cancel(conn: Any, ns: str, rid: str) -> None:
    """The client went away: the worker drops the request at its next token, or skips it untaken."""
    await conn.set(f"{ns}:cancel:{rid}", 1, ex=600)


async def replies(
    conn: Any, ns: str, rid: str, deadline: float, *, wanted: Callable[[], Awaitable[bool]] | None = None
) -> AsyncIterator[dict[str, Any]]:
    """The worker's messages for ``rid`` until ``done`` or an ``error`` (both yielded). Raises
    ``WorkerLost`` when the worker that held it is gone (or, while it waits untaken, when no worker
    is left), ``TimedOut`` past ``deadline``, ``ClientGone`` when ``wanted()`` (asked at each quiet
    second) says nobody waits any more."""
    reply, lease = f"{ns}:reply:{rid}", f"{ns}:lease:{rid}"
    held = False
    while True:
        left = deadline - time.time()
        if left <= 0:
            raise TimedOut()
        item = await conn.blpop([reply], timeout=min(1.0, max(0.01, left)))
        if item is not None:
            # Whatever else is there comes in the same round trip: a batch writes a token a row a step.
            for raw in [item[1], *(await conn.lpop(reply, READ_AT_ONCE) or [])]:
                message: dict[str, Any] = json.loads(raw)
                yield message
                if message["t"] in ("done", "error"):
                    return
            held = True
            continue
        if wanted is not None and not await wanted():
            raise ClientGone()
        if await conn.exists(lease):
            held = True
        elif held and not await conn.llen(reply):
            raise WorkerLost()
        elif not held and not await conn.zcount(f"{ns}:workers", time.time(), "+inf"):
            raise WorkerLost()  # queued, and every worker is gone: none will take it


def ask(envelope: dict[str, Any], *, timeout: float, queue: str | None = None) -> dict[str, Any]:
    """A request that is no completion (a remote reward model's batch), from sync code: queued on
    ``queue`` (the inference workers' own by default) in its ``project``'s lane (none: the system's),
    then its one last message waited for. Raises ``NoWorker``, ``WorkerLost``, ``TimedOut`` or
    ``Unreachable``."""
    import redis

    from service.core.settings import get_settings

    ns = namespace(queue or serve_queue())
    conn = redis.Redis.from_url(get_settings().redis_client_url, socket_timeout=30, socket_connect_timeout=5)
    try:
        if not live_workers(conn, ns):
            raise NoWorker()
        deadline = time.time() + timeout
        submit_sync(conn, ns, {**envelope, "deadline": deadline})
        held = False
        while time.time() < deadline:
            item = conn.blpop([f"{ns}:reply:{envelope['id']}"], timeout=1)
            if item is not None:
                answer: dict[str, Any] = json.loads(item[1])
                return answer
            if conn.exists(f"{ns}:lease:{envelope['id']}"):
                held = True
            elif held or not live_workers(conn, ns):
                raise WorkerLost()  # its worker is gone, or (queued) every worker is
        conn.set(f"{ns}:cancel:{envelope['id']}", 1, ex=600)  # no worker takes it now
        raise TimedOut()
    except redis.RedisError as exc:
        raise Unreachable(f"{type(exc).__name__}: {exc}") from exc
    finally:
        conn.close()


# The worker's side -------------------------------------------------------------------------------------
def take(conn: Any, ns: str, worker: str, *, block: float, most: int) -> list[dict[str, Any]]:
    """Up to ``most`` requests, in turn between projects and their keys (``_POP``), waiting up to
    ``block`` seconds for the first (0: none); each one leased to ``worker``. Requests cancelled or
    past their deadline are dropped here."""
    if most <= 0:
        return []
    raw: list[Any] = conn.eval(_POP, 3, f"{ns}:projects", f"{ns}:ready", f"{ns}:turns", ns, most, 0)
    if not raw and block > 0 and conn.blpop([f"{ns}:ready"], timeout=block) is not None:
        raw = conn.eval(_POP, 3, f"{ns}:projects", f"{ns}:ready", f"{ns}:turns", ns, most, 1)
    taken = []
    for item in raw:
        envelope = json.loads(item)
        if envelope["deadline"] <= time.time() or conn.exists(f"{ns}:cancel:{envelope['id']}"):
            continue
        hold(conn, ns, worker, envelope["id"])
        taken.append(envelope)
    return taken


def hold(conn: Any, ns: str, worker: str, rid: str) -> None:
    pipe = conn.pipeline()
    pipe.set(f"{ns}:lease:{rid}", worker, ex=LEASE_SECONDS)
    pipe.sadd(f"{ns}:inflight:{worker}", rid)
    pipe.expire(f"{ns}:inflight:{worker}", 24 * 3600)
    pipe.execute()


def heartbeat(conn: Any, ns: str, worker: str, held: list[str], *, warm: bool = False) -> None:
    """``worker`` is alive (and ``warm``: its preloaded models loaded) and holds ``held``."""
    pipe = conn.pipeline()
    for live in ("workers", "warm") if warm else ("workers",):
        pipe.zadd(f"{ns}:{live}", {worker: time.time() + LEASE_SECONDS})
        pipe.zremrangebyscore(f"{ns}:{live}", "-inf", time.time())
    for rid in held:
        pipe.set(f"{ns}:lease:{rid}", worker, ex=LEASE_SECONDS)
    pipe.execute()


def push(conn: Any, ns: str, messages: list[tuple[str, dict[str, Any]]]) -> None:
    """Append each ``(request id, message)`` to its request's replies, in one round trip."""
    if not messages:
        return
    pipe = conn.pipeline()
    for rid, message in messages:
        pipe.rpush(f"{ns}:reply:{rid}", json.dumps(message, ensure_ascii=False, allow_nan=False))
        pipe.expire(f"{ns}:reply:{rid}", 300)  # nobody waits longer; the key must not linger
    pipe.execute()


def finish(conn: Any, ns: str, worker: str, rid: str, last: dict[str, Any]) -> None:
    """The request's last message (``done`` or ``error``), then its lease let go: in that order, so
    the API never sees the lease gone before the answer."""
    push(conn, ns, [(rid, last)])
    pipe = conn.pipeline()
    pipe.delete(f"{ns}:lease:{rid}")
    pipe.srem(f"{ns}:inflight:{worker}", rid)
    pipe.execute()


def cancelled(conn: Any, ns: str, rids: list[str]) -> set[str]:
    if not rids:
        return set()
    flags = conn.mget([f"{ns}:cancel:{rid}" for rid in rids])
    return {rid for rid, flag in zip(rids, flags, strict=True) if flag is not None}


def worker_gone(conn: Any, ns: str, worker: str) -> int:
    """A worker process died: each request it held is answered 503 (the supervisor's call)."""
    held = [r.decode() if isinstance(r, bytes) else r for r in conn.smembers(f"{ns}:inflight:{worker}")]
    for rid in held:
        with contextlib.suppress(Exception):
            finish(conn, ns, worker, rid, lost_message())
    conn.delete(f"{ns}:inflight:{worker}")
    conn.zrem(f"{ns}:workers", worker)
    conn.zrem(f"{ns}:warm", worker)
    return len(held)


def lost_message() -> dict[str, Any]:
    return {
        "t": "error",
        "status": 503,
        "code": "worker_lost",
        "message": "The inference worker serving this request stopped; send it again.",
        "param": None,
    }


def error_message(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"t": "error", "status": status, "code": code, "message": message, "param": param}


WIRE_KINDS: dict[int, type[errors.DomainError]] = {
    400: errors.Invalid,
    404: errors.NotFound,
    409: errors.Conflict,
    410: errors.Gone,
    413: errors.TooLarge,
    429: errors.LimitReached,
    502: errors.UpstreamFailed,
    503: errors.Unavailable,
    504: errors.TimedOut,
}
"""What the statuses of a worker's error answer mean: the bus speaks in statuses, as HTTP does, and
each is the kind the API answers with that same status (``tests/api/test_errors.py`` holds the two
tables to each other); any other is the service's failure (``Failed``)."""


def error_of(answer: dict[str, Any]) -> errors.DomainError:
    """A worker's error answer (``error_message``) as the domain's error."""
    kind = WIRE_KINDS.get(int(answer["status"]), errors.Failed)
    return kind(answer["message"], param=answer.get("param"), code=answer.get("code"))
