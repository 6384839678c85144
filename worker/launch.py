"""Starting a run's ranks: ``resources.gpus: N > 1`` runs as N processes of ``worker.rank`` under
PyTorch's elastic launcher (``torch.distributed.run``: one process a device, ``LOCAL_RANK``, a
rendezvous on this host), NCCL on GPUs, gloo on CPUs. The caller (a Celery task, or ``rloo train``)
waits for them here and gets the run's ``TrainResult`` back, as ``worker.train.train`` gives it to
one process.

A rank that dies (killed, out of memory) ends every rank of the run: the launcher stops the others
(``--max-restarts 0``), and a collective never waits past ``RLOO_COLLECTIVE_TIMEOUT_SECONDS``. The
caller then gets ``RanksLost`` and the job continues from its last checkpoint, as after any crash;
an error a rank reports (bad data, a grader that cannot run) fails the run with that error.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.records import JobError

if TYPE_CHECKING:  # the Celery task that starts ranks imports no torch itself
    from worker.config import TrainConfig
    from worker.loop import TrainResult


class RanksLost(Exception):
    """A rank ended without a word (killed, or a collective timed out): the run can continue from
    its last checkpoint."""


def run_ranks(
    cfg: TrainConfig, *, job_id: str | None = None, holder: str | None = None, timeout_seconds: float = 600
) -> TrainResult:
    """Run ``cfg`` on ``cfg.gpus`` ranks and wait for them. With ``job_id`` rank 0 records to that
    job's rows as ``holder`` (the worker process that claimed it); without, it prints each step
    (``rloo train``)."""
    with tempfile.TemporaryDirectory(prefix="rloo-ranks-") as scratch:
        where = Path(scratch)
        # The config goes to our own child processes as a file only they read: nothing crosses a network.
        (where / "config.pkl").write_bytes(pickle.dumps(cfg))
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={cfg.gpus}",
            "--max-restarts=0",
            "--monitor-interval=0.5",
            "-m",
            "worker.rank",
            str(where),
        ]
        if job_id is not None:
            command += ["--job", job_id, "--holder", holder or ""]
        env = {
            **os.environ,
            "RLOO_RANKS_BACKEND": "gloo" if cfg.device == "cpu" else "",
            "RLOO_COLLECTIVE_TIMEOUT_SECONDS": str(timeout_seconds),
        }
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.gpus)))
        # Its own process group: stopping this worker stops the launcher and every rank with it.
        launcher = subprocess.Popen(command, env=env, start_new_session=True)
        try:
            code = launcher.wait()
        except BaseException:
            _stop(launcher)
            raise
        return _outcome(where, code, cfg.gpus)


def _stop(launcher: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)


def _outcome(where: Path, code: int, ranks: int) -> TrainResult:
    """Rank 0's result, or the error a rank reported, or ``RanksLost``."""
    from worker.loop import TrainResult

    reports = [json.loads(p.read_text()) for p in sorted(where.glob("rank-*.json"))]
    for report in reports:
        if "result" in report:
            result = report["result"]
            final = result.get("final_checkpoint")
            return TrainResult(**{**result, "final_checkpoint": Path(final) if final else None})
    for report in reports:
        if "error" in report:
            raise JobError(report["error"]["code"], report["error"]["message"])
    raise RanksLost(f"a rank of the job's {ranks} ended without a word (exit status {code})")


def result_report(result: TrainResult) -> dict[str, Any]:
    """What rank 0 hands back to ``run_ranks``."""
    data = asdict(result)
    data["final_checkpoint"] = str(result.final_checkpoint) if result.final_checkpoint else None
    return {"result": data}
