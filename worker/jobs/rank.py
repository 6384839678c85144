"""One rank of a multi-rank run: what ``torch.distributed.run`` starts N times (``worker.engine.distributed.launch``).

``python -m worker.jobs.rank DIR [--job ID --holder NAME]``: DIR holds the run's config (written by
``run_ranks``); each rank joins the process group, runs the method's loop on its share
(``worker.engine.distributed.ranks``) and writes ``DIR/rank-R.json``: rank 0 the run's result, any rank the error
that ended it. Rank 0 records to the job's rows as the worker process that claimed the job (its
``holder``), or prints each step for ``rloo train``; the other ranks record nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

log = logging.getLogger("rloo.rank")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.jobs.rank")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--job")
    parser.add_argument("--holder")
    args = parser.parse_args(argv)

    from worker.engine.distributed.launch import result_report
    from worker.engine.distributed.ranks import join, leave
    from worker.engine.errors import JobError
    from worker.jobs.failures import classify

    rank = int(os.environ.get("RANK", "0"))
    report: dict[str, Any]
    try:
        ranks = join(float(os.environ["RLOO_COLLECTIVE_TIMEOUT_SECONDS"]))
        cfg = pickle.loads((args.dir / "config.pkl").read_bytes())
        from worker.engine.methods.rloo import train

        report = result_report(train(cfg, _recorder(args, ranks.is_main)))
    except JobError as exc:
        report = {"error": {"code": exc.code, "message": exc.message}}
    except Exception as exc:
        log.exception("rank %d failed", rank)
        if _lost_a_peer(exc):  # not this job's error: another rank is gone (the launcher ends us all)
            report = {"lost": {"rank": rank, "message": f"{type(exc).__name__}: {exc}"[:500]}}
        else:
            code, message = classify(exc)
            report = {"error": {"code": code, "message": message}}
    if rank == 0 or "result" not in report:
        out = args.dir / f"rank-{rank}.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report))
        tmp.rename(out)
    if "result" in report:
        leave()
    return 0 if "result" in report else 1


LOST_PEER = (
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "read error",
    "timed out",
    "timeout",
)
"""What a collective says when its peer is gone or never answered."""


def _lost_a_peer(exc: BaseException) -> bool:
    """A collective that failed because another rank is gone or never answered (a closed
    connection, the timeout): not the job's error. A collective's other failures (mismatched
    shapes, a device out of memory) are the job's."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistNetworkError | dist.DistStoreError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(words in text for words in LOST_PEER)


def _recorder(args: argparse.Namespace, main: bool) -> Any:
    from worker.engine.recorders import QuietRecorder, StdoutRecorder

    if not main:
        return QuietRecorder()
    if args.job is None:
        return StdoutRecorder()
    from service.core import crud
    from service.core.db import session_scope
    from worker.jobs.database_recorder import DatabaseRecorder

    with session_scope() as session:
        job = crud.get_job_by_id(session=session, job_id=args.job)
        if job is None:
            raise SystemExit(f"job {args.job} is gone")
        session.expunge(job)
    return DatabaseRecorder(job, holder=args.holder or None)


if __name__ == "__main__":
    raise SystemExit(main())
