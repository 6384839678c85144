"""One rank of a multi-rank run: what ``torch.distributed.run`` starts N times (``worker.launch``).

``python -m worker.rank DIR [--job ID --holder NAME]``: DIR holds the run's config (written by
``run_ranks``); each rank joins the process group, runs the method's loop on its share
(``worker.ranks``) and writes ``DIR/rank-R.json``: rank 0 the run's result, any rank the error
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
    parser = argparse.ArgumentParser(prog="python -m worker.rank")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--job")
    parser.add_argument("--holder")
    args = parser.parse_args(argv)

    from worker.failures import classify
    from worker.launch import result_report
    from worker.ranks import join, leave
    from worker.records import JobError

    ranks = join(float(os.environ.get("RLOO_COLLECTIVE_TIMEOUT_SECONDS", "600")))
    cfg = pickle.loads((args.dir / "config.pkl").read_bytes())
    report: dict[str, Any]
    try:
        from worker.train import train

        result = train(cfg, _recorder(args, ranks.is_main))
        report = result_report(result)
    except JobError as exc:
        report = {"error": {"code": exc.code, "message": exc.message}}
    except Exception as exc:
        log.exception("rank %d failed", ranks.rank)
        if _lost_a_peer(exc):
            return 1  # another rank ended (or hung): no error of this job's to report; the launcher says so
        code, message = classify(exc)
        report = {"error": {"code": code, "message": message}}
    if ranks.is_main or "error" in report:
        out = args.dir / f"rank-{ranks.rank}.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report))
        tmp.rename(out)
    if "error" not in report:
        leave()
    return 1 if "error" in report else 0


def _lost_a_peer(exc: BaseException) -> bool:
    """A collective that failed because another rank is gone or never came (a closed connection,
    the timeout): not the job's error."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in ("gloo", "nccl", "connection closed"))


def _recorder(args: argparse.Namespace, main: bool) -> Any:
    from worker.records import QuietRecorder, StdoutRecorder

    if not main:
        return QuietRecorder()
    if args.job is None:
        return StdoutRecorder()
    from service import crud
    from service.db import session_scope
    from worker.recording import DatabaseRecorder

    with session_scope() as session:
        job = crud.get_job_by_id(session=session, job_id=args.job)
        if job is None:
            raise SystemExit(f"job {args.job} is gone")
        session.expunge(job)
    return DatabaseRecorder(job, holder=args.holder or None)


if __name__ == "__main__":
    raise SystemExit(main())
