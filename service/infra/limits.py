"""Limits counted in Redis, so that every API process (and every host) sharing it gives a key the
same limits as one process would: a GCRA rate (a key's requests, its request-body bytes, a Tinker
loop's requests) and leases (a key's open event streams).

Each count is one Lua script, atomic in Redis. The time is the caller's wall clock (hosts agree
to NTP's precision: a skew of 50 ms lets a key of 20 requests a second one request more), so a test
can hold it still. Where Redis does not answer within ``TIMEOUT``, the caller's own per-process
counter decides, and Redis is left alone for ``RETRY_SECONDS`` before it is asked again; ``state()``
says which counts hold (``/readyz`` shows it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("rloo.limits")

# GCRA: a key's theoretical arrival time (TAT) in KEYS[1]; ARGV: now, interval, window, cost. A
# request passes when TAT + cost*interval lies at most `window` ahead of now, and moves TAT on.
_GCRA = """
local now = tonumber(ARGV[1])
local interval = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local tat = tonumber(redis.call('GET', KEYS[1]) or ARGV[1])
if tat < now then tat = now end
local ahead = tat + cost * interval - now
if ahead > window + 1e-6 then
  return {0, string.format('%.6f', ahead - window), string.format('%.6f', tat - now)}
end
redis.call('SET', KEYS[1], string.format('%.6f', tat + cost * interval), 'PX', math.ceil(ahead * 1000) + 1000)
return {1, string.format('%.6f', ahead), '0'}
"""

# A lease among at most ARGV[4] in the sorted set KEYS[1] (score: when it lapses); ARGV: now,
# lapses at, lease id, cap. Lapsed leases (a process that died holding them) are dropped first.
_LEASE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) - tonumber(ARGV[1])) + 60)
return 1
"""


def clock() -> float:
    """The limits' clock, the API's rate limits' too: wall time, which hosts share, as the counts in
    Redis need (a test holds it still, so that a burst is one instant whatever the machine's speed)."""
    return time.time()


class Lease:
    """A held lease: ``renew()`` before it lapses, ``release()`` once done (both never raise)."""

    def __init__(
        self, renew: Callable[[], Awaitable[None]] | None = None, release: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self._renew, self._release = renew, release

    async def renew(self) -> None:
        if self._renew is not None:
            await self._renew()

    async def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            await release()


class SharedLimits:
    """One process's door to the counts in Redis (``redis_url``, keys under ``namespace``)."""

    TIMEOUT = 0.25
    RETRY_SECONDS = 5.0

    def __init__(self, redis_url: str, namespace: str) -> None:
        self.redis_url, self.namespace = redis_url, namespace
        self.down_until = 0.0
        self.down_since: float | None = None
        self._conn: Any = None
        self._loop: Any = None
        self._scripts: dict[str, Any] = {}

    def state(self) -> dict[str, Any]:
        """Which counts hold now: ``shared`` (Redis), or ``local`` since when and why."""
        if self.down_since is None:
            return {"limits": "shared"}
        return {
            "limits": "local",
            "since": int(self.down_since),
            "why": "Redis did not answer: each API process counts a key's rate and streams on its own",
        }

    async def rate(
        self, name: str, key: str, *, rate: float, burst: int, cost: float, now: float
    ) -> tuple[bool, int, float, float] | None:
        """GCRA in Redis: (allowed, units left, seconds until allowed, seconds until full), or None
        when Redis did not answer (count it locally)."""
        interval = 1.0 / rate
        window = burst * interval
        answer = await self._call(_GCRA, 1, self._key("rate", name, key), repr(now), repr(interval), repr(window), cost)
        if answer is None:
            return None
        allowed, first, second = int(answer[0]), float(answer[1]), float(answer[2])
        if not allowed:
            return False, 0, first, second
        return True, int((window - first) * rate + 1e-3), 0.0, first

    async def lease(self, name: str, key: str, *, cap: int, ttl: float) -> Lease | None | bool:
        """One of ``key``'s at most ``cap`` leases, lapsing ``ttl`` seconds after its last renewal:
        the Lease, False when all are taken, or None when Redis did not answer."""
        zset, lease_id = self._key("lease", name, key), secrets.token_hex(8)
        now = clock()
        taken = await self._call(_LEASE, 1, zset, repr(now), repr(now + ttl), lease_id, cap)
        if taken is None:
            return None
        if not int(taken):
            return False

        async def renew() -> None:
            # Added again if it lapsed meanwhile (Redis restarted, a long stall): the stream holds its place.
            await self._call_quietly("zadd", zset, {lease_id: clock() + ttl})

        async def release() -> None:
            await self._call_quietly("zrem", zset, lease_id)

        return Lease(renew, release)

    def _key(self, kind: str, name: str, key: str) -> str:
        return f"{self.namespace}:limits:{kind}:{name}:{key}"

    async def close(self) -> None:
        """Let the connection go (the app's shutdown); a later call connects again."""
        conn, self._conn = self._conn, None
        if conn is not None and self._loop is asyncio.get_running_loop():
            with contextlib.suppress(Exception):  # Redis gone meanwhile: nothing to let go
                await conn.aclose()

    async def _connection(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._conn is None or self._loop is not loop:
            import redis.asyncio

            self._conn = redis.asyncio.Redis.from_url(
                self.redis_url, socket_timeout=self.TIMEOUT, socket_connect_timeout=self.TIMEOUT
            )
            self._loop = loop
            # EVALSHA, the script sent again only when Redis lost it (a restart)
            self._scripts = {s: self._conn.register_script(s) for s in (_GCRA, _LEASE)}
        return self._conn

    async def _call(self, script: str, nkeys: int, *args: Any) -> Any:
        if time.monotonic() < self.down_until:
            return None
        try:
            await self._connection()
            keys, argv = list(args[:nkeys]), list(args[nkeys:])
            answer = await asyncio.wait_for(self._scripts[script](keys=keys, args=argv), timeout=2 * self.TIMEOUT)
        except Exception as exc:  # down, refused, timed out, or lost mid-call: count locally for a while
            self._went_down(exc)
            return None
        if self.down_since is not None:
            log.warning("Redis answers again: rate limits and stream caps are shared by the API processes again")
            self.down_since = None
        return answer

    async def _call_quietly(self, command: str, *args: Any, **kwargs: Any) -> None:
        if time.monotonic() < self.down_until:
            return
        try:
            conn = await self._connection()
            await asyncio.wait_for(getattr(conn, command)(*args, **kwargs), timeout=2 * self.TIMEOUT)
        except Exception as exc:  # the lease lapses by itself
            self._went_down(exc)

    def _went_down(self, exc: BaseException) -> None:
        self.down_until = time.monotonic() + self.RETRY_SECONDS
        if self.down_since is None:
            self.down_since = time.time()
            log.warning(
                "Redis did not answer (%s): each API process counts rate limits and stream caps on its own "
                "until it does",
                type(exc).__name__,
            )
