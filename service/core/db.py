"""Engine and sessions. SQLite gets WAL and a busy timeout so the API and a worker share one file."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from service.core.settings import get_settings

T = TypeVar("T")


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # A SQLite connection is a file handle: keep one for each of the API's worker threads (40), so
        # that no request pays a connect and its PRAGMAs; more are opened when needed and closed after.
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=48,
            max_overflow=-1,
            hide_parameters=True,  # SQL errors never carry values (a key's hash, a user's text) into logs
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
            cur.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes under WAL
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    # pool_pre_ping: a database that restarted must not cost the next request a 500. The pool holds
    # a connection for each of the API's worker threads (40) and then some: a request never waits
    # for a connection while another waits for a thread, and none is opened and closed per request.
    return create_engine(url, pool_pre_ping=True, pool_size=20, max_overflow=30, hide_parameters=True)


@lru_cache
def get_engine() -> Engine:
    return make_engine(get_settings().database_url)


@lru_cache
def _sessionmaker() -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(), expire_on_commit=False)


async def get_session() -> AsyncIterator[Session]:
    """FastAPI dependency: one session a request, closed here, on the event loop: giving a pooled
    connection back must never wait for a worker thread. (With the close in a thread, 128 concurrent
    requests held every connection while waiting for a thread, while every thread waited for a
    connection: the API stalled.) Async handlers end their session in ``run_db`` already, so this
    close costs nothing; a sync handler that leaves a transaction open pays its ROLLBACK here."""
    session = _sessionmaker()()
    try:
        yield session
    finally:
        session.close()


def new_session() -> Session:
    """A session of its own, for work that outlives a request's (a stream's reads)."""
    return _sessionmaker()()


@contextmanager
def session_scope() -> Iterator[Session]:
    """A session for the worker and the CLI; the caller commits."""
    with _sessionmaker()() as session:
        yield session


def reset_caches() -> None:
    """Forget engine and settings (tests that change the environment call this)."""
    if get_engine.cache_info().currsize:
        get_engine().dispose()
    get_engine.cache_clear()
    _sessionmaker.cache_clear()
    get_settings.cache_clear()


_SQLITE_WRITES = threading.Lock()


def write_lock(session: Session) -> AbstractContextManager[object]:
    """Hold around a request's writes, from the first INSERT to the commit. On SQLite, the API's
    threads take turns here instead of in SQLite's busy handler, which sleeps in steps of up to
    100 ms (job creation at 32 concurrent requests had a p99 of 1.4 s); elsewhere, nothing."""
    bind = session.get_bind()
    return _SQLITE_WRITES if bind.dialect.name == "sqlite" else nullcontext()


async def run_db(session: Session, fn: Callable[..., T], *args: Any) -> T:
    """An async handler's whole database work, ``fn(*args)`` (short reads), then the session is
    closed (its objects stay loaded, detached): inline on SQLite (a local file, read in WAL mode
    without waiting for writers: a thread hop would cost more than the read), in one worker thread
    on a server database (round trips must not hold the event loop), where the connection is given
    back before the thread is, so no request holds one while it waits for a thread."""

    def work() -> T:
        try:
            return fn(*args)
        finally:
            session.close()

    if session.get_bind().dialect.name == "sqlite":
        return work()
    from anyio import to_thread

    return await to_thread.run_sync(work)


def ends_session(handler: Callable[..., T]) -> Callable[..., T]:
    """For a sync handler (which FastAPI runs in a worker thread): close its ``session`` in that same
    thread when it returns, so the transaction's end (a ROLLBACK round trip on a server database)
    never runs on the event loop, and the connection is back in the pool before the thread is."""

    @functools.wraps(handler)
    def run(*args: Any, **kwargs: Any) -> T:
        try:
            return handler(*args, **kwargs)
        finally:
            kwargs["session"].close()

    return run


def database_unreachable(exc: BaseException) -> bool:
    """An error that says the database could not be reached or the connection broke (a restart, a
    network cut, a full pool), rather than a bad statement: the request may simply be retried."""
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, sa_exc.OperationalError) and str(exc.orig).startswith(("no such ", "table ")):
        return False  # SQLite's way to say the schema is behind the code: `rloo db upgrade`, not a retry
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError)):
        return True
    if isinstance(exc, sa_exc.TimeoutError):  # no pooled connection came free in time
        return True
    return isinstance(exc, sa_exc.DBAPIError) and bool(exc.connection_invalidated)


def retrying(fn: Callable[[], T], *, seconds: float, what: str) -> T:
    """``fn()``, tried again while the database is unreachable, for up to ``seconds``: a worker rides
    out a database restart or a network blip instead of failing a job that has trained for hours.
    ``fn`` must be one whole transaction (a failed attempt rolled back, nothing half-written)."""
    deadline = time.monotonic() + seconds
    pause = 0.25
    while True:
        try:
            return fn()
        except Exception as exc:
            if not database_unreachable(exc) or time.monotonic() + pause > deadline:
                raise
            logging.getLogger("rloo.db").warning(
                "%s: the database is unreachable (%s); trying again in %.2g s", what, _reason(exc), pause
            )
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


def _reason(exc: BaseException) -> str:
    """The driver's own words, first line (engines hide statement parameters, so no value leaks)."""
    orig = getattr(exc, "orig", None) or exc
    return f"{type(orig).__name__}: {str(orig).strip().splitlines()[0][:200] if str(orig).strip() else ''}"
