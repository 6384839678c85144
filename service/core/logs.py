"""Log lines as text (the default) or, with ``RLOO_LOG_FORMAT=json``, one JSON object a line for a
log shipper: ``{time, level, logger, message, job_id, process}`` plus ``exception`` when there is
one. ``job_id`` is the job a worker process is running (``job_scope``), else the first job id the
message names, else null: every line about a job can be found by its id."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from contextvars import ContextVar

JOB_ID: ContextVar[str | None] = ContextVar("rloo_job_id", default=None)
_NAMED_JOB = re.compile(r"ftjob-[0-9a-f]{8,}")


@contextlib.contextmanager
def job_scope(job_id: str) -> Iterator[None]:
    """Lines logged inside carry ``job_id``."""
    token = JOB_ID.set(job_id)
    try:
        yield
    finally:
        JOB_ID.reset(token)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        named = _NAMED_JOB.search(message)
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": message,
            "job_id": JOB_ID.get() or (named.group() if named else None),
            "process": os.getpid(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure(log_format: str, loggers: tuple[str, ...] = ("", "uvicorn", "uvicorn.error", "celery")) -> None:
    """With ``json``, every handler of ``loggers`` (the root's, uvicorn's and Celery's) writes JSON;
    a logger without one (the root, before anything set it up) gets a stderr handler."""
    if log_format != "json":
        return
    formatter = JsonFormatter()
    for name in loggers:
        logger = logging.getLogger(name)
        if not name and not logger.handlers:
            logger.addHandler(logging.StreamHandler())
            logger.setLevel(logging.INFO)
        for handler in logger.handlers:
            handler.setFormatter(formatter)
