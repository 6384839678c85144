"""Starting a run's ranks: ``resources.gpus: N > 1`` runs as N processes of ``worker.jobs.rank`` under
PyTorch's elastic launcher (``torch.distributed.run``: one process a device, ``LOCAL_RANK``, a
rendezvous on this host), NCCL on GPUs, gloo on CPUs. The caller (a Celery task, or ``rloo train``)
waits for them here and gets the run's ``TrainResult`` back, as ``worker.engine.methods.rloo.train`` gives it to
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

from worker.engine.cpu_threads import share as rank_threads
from worker.engine.errors import JobError
from worker.engine.processes import die_with_parent

if TYPE_CHECKING:  # importing this module (worker.jobs.tasks does, in Celery's parent process) imports no torch
    from worker.engine.config import TrainConfig
    from worker.engine.loop import TrainResult


class RanksLost(Exception):
    """A rank ended without a word (killed, or a collective timed out): the run can continue from
    its last checkpoint."""


def run_ranks(
    cfg: TrainConfig, *, timeout_seconds: float, job_id: str | None = None, holder: str | None = None
) -> TrainResult:
    """Run ``cfg`` on ``cfg.gpus`` ranks and wait for them. With ``job_id`` rank 0 records to that
    job's rows as ``holder`` (the worker process that claimed it); without, it prints each step
    (``rloo train``). Every collective waits at most ``timeout_seconds``."""
    _check_devices(cfg)
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
            "worker.jobs.rank",
            str(where),
        ]
        if job_id is not None:
            command += ["--job", job_id, "--holder", holder or ""]
        env = {
            **os.environ,
            "RLOO_RANKS_BACKEND": "gloo" if cfg.device == "cpu" else "",
            "RLOO_COLLECTIVE_TIMEOUT_SECONDS": str(timeout_seconds),
        }
        # The ranks share this process's CPU threads (worker.engine.cpu_threads): none oversubscribed.
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(rank_threads(cfg.gpus))
        # Its own process group, which stopping this worker stops; and, should this process die
        # without a word (the out-of-memory killer), the kernel stops the launcher, which stops
        # every rank: no ranks are left training a job that runs again elsewhere.
        launcher = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=die_with_parent)
        try:
            code = launcher.wait()
        except BaseException:
            _stop(launcher)
            raise
        return _outcome(where, code, cfg.gpus)


def _check_devices(cfg: TrainConfig) -> None:
    """A job asking for more GPUs than this host has fails with what to change, not a lost rank."""
    if cfg.device == "cpu":
        return
    import torch

    have = torch.cuda.device_count()
    if have and have < cfg.gpus:
        raise JobError(
            "insufficient_devices",
            f"the job asks for {cfg.gpus} GPUs (resources.gpus) and its worker has {have}; "
            f"run it on a worker with {cfg.gpus} (rloo worker --gpus) or ask for {have}",
        )


def _stop(launcher: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)


def _outcome(where: Path, code: int, ranks: int) -> TrainResult:
    """Rank 0's result; else the job's error a rank reported; else ``RanksLost``: a rank that died
    without a report (killed) or collectives that lost a rank or timed out."""
    from worker.engine.loop import TrainResult

    reports = [json.loads(p.read_text()) for p in sorted(where.glob("rank-*.json"))]
    for report in reports:
        if "result" in report:
            result = report["result"]
            final = result.get("final_checkpoint")
            return TrainResult(**{**result, "final_checkpoint": Path(final) if final else None})
    for report in reports:
        if "error" in report:
            raise JobError(report["error"]["code"], report["error"]["message"])
    lost = [r["lost"] for r in reports if "lost" in r]
    why = f"; rank {lost[0]['rank']}: {lost[0]['message']}" if lost else ""
    raise RanksLost(f"{ranks - len(reports)} of the job's {ranks} ranks ended without a word (exit status {code}){why}")


def result_report(result: TrainResult) -> dict[str, Any]:
    """What rank 0 hands back to ``run_ranks``."""
    data = asdict(result)
    data["final_checkpoint"] = str(result.final_checkpoint) if result.final_checkpoint else None
    return {"result": data}
