"""``python -m benchmarks.soak [--minutes M] [--seed S]`` (``make soak``): the chaos soak.

The whole stack as processes (``stack.py``), three projects' clients at once (``clients.py``), and a
seeded schedule of faults (``faults.py``) for ``--minutes``; then no new jobs, the running ones given
``--drain`` seconds to end, and the checks (``checks.py``). Prints one JSON object (figures and
problems) and exits 1 on any problem. Loopback only; it stops by itself."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.soak import checks
from benchmarks.soak.clients import Client, Request, Tenant, run_tenant
from benchmarks.soak.faults import KINDS, Fault, Injector
from benchmarks.soak.stack import SoakStack

TENANTS = ("acme", "globex", "initech")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=5.0, help="How long faults are injected (default 5).")
    parser.add_argument("--seed", type=int, default=1, help="The schedule's and the clients' seed.")
    parser.add_argument("--drain", type=float, default=300.0, help="Seconds the jobs get to end afterwards.")
    parser.add_argument("--gap", type=float, nargs=2, default=(6.0, 15.0), help="Seconds between faults.")
    parser.add_argument("--home", type=Path, default=None, help="Where the stack's files and logs go.")
    args = parser.parse_args(argv)
    home = args.home or Path(tempfile.mkdtemp(prefix="rloo-soak-"))
    report = soak(home, minutes=args.minutes, seed=args.seed, drain=args.drain, gap=tuple(args.gap))
    print(json.dumps(report, indent=2))
    return 1 if report["problems"] else 0


def soak(home: Path, *, minutes: float, seed: int, drain: float, gap: tuple[float, float]) -> dict[str, Any]:
    from worker.tiny.models import build_tiny_causal_lm

    models = home / "models"
    build_tiny_causal_lm(models / "tiny-policy", seed=0)
    stack = SoakStack(home, models)
    try:
        stack.up()
        return _run(stack, minutes=minutes, seed=seed, drain=drain, gap=gap)
    finally:
        stack.down()


def _run(stack: SoakStack, *, minutes: float, seed: int, drain: float, gap: tuple[float, float]) -> dict[str, Any]:
    rng = random.Random(seed)
    tenants = [
        Tenant(name, stack.cli("keys", "create", "--project", name).strip().splitlines()[-1]) for name in TENANTS
    ]
    operator = stack.cli("keys", "create", "--project", "soak-ops", "--operator").strip().splitlines()[-1]
    stack.cli("projects", "quota", TENANTS[0], "running_jobs=2")
    urls = [stack.url("api-1"), stack.url("api-2")]
    log: list[Request] = []
    lock = threading.Lock()
    stop, new_jobs = threading.Event(), threading.Event()
    new_jobs.set()
    threads = [
        threading.Thread(
            target=run_tenant,
            args=(Client(urls, t, log, lock), random.Random(rng.random()), stop),
            kwargs={"new_jobs": new_jobs},
            daemon=True,
        )
        for t in tenants
    ]
    started = time.time()
    for thread in threads:
        thread.start()
    faults = _inject(stack, Injector(stack, operator, (TENANTS[1], tenants[1].key)), rng, minutes, gap)
    new_jobs.clear()
    ended = _drain(stack, drain)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    duration = time.time() - started
    return _report(stack, tenants, log, faults, duration=duration, drained=ended, seed=seed, minutes=minutes)


def _inject(
    stack: SoakStack, injector: Injector, rng: random.Random, minutes: float, gap: tuple[float, float]
) -> list[Fault]:
    faults: list[Fault] = []
    until = time.time() + minutes * 60
    order = list(KINDS)
    while time.time() < until:
        time.sleep(rng.uniform(*gap))
        if not order:
            order = list(KINDS)
        kind = order.pop(rng.randrange(len(order)))  # every kind before any twice
        faults.append(injector.inject(kind, rng))
    return faults


def _drain(stack: SoakStack, seconds: float) -> bool:
    from sqlalchemy import select

    from service.core.tables import Job

    deadline = time.time() + seconds
    while time.time() < deadline:
        with stack.session() as session:
            if all(s in checks.FINAL for s in session.scalars(select(Job.status))):
                return True
        time.sleep(2)
    return False


def _report(
    stack: SoakStack, tenants: list[Tenant], log: list[Request], faults: list[Fault], **figures: Any
) -> dict[str, Any]:
    from sqlalchemy import select

    from service.core.settings import Settings
    from service.core.tables import Job

    artifacts = Settings(home=Path(stack.env["RLOO_HOME"])).artifacts_dir
    problems: dict[str, list[str]] = {}
    with stack.session() as session:
        statuses = Counter(session.scalars(select(Job.status)))
        methods = Counter((j.method or {}).get("type") for j in session.scalars(select(Job)))
        problems["jobs_ended"] = checks.jobs_ended(session)
        problems["steps_once_and_checkpoints_load"] = checks.steps_once_and_checkpoints_load(session, artifacts)
        problems["one_worker_at_a_time"] = checks.one_worker_at_a_time(session)
        problems["nothing_orphaned"] = checks.nothing_orphaned(session, artifacts)
        problems["one_job_per_idempotency_key"] = checks.one_job_per_idempotency_key(session, tenants)
        problems["usage_adds_up"] = checks.usage_adds_up(session)
    problems["requests_answered"], requests = checks.requests_answered(log, faults)
    recoveries = [f.seconds for f in faults if f.seconds is not None]
    return {
        **figures,
        "jobs": dict(statuses),
        "methods": dict(methods),
        "jobs_succeeded_per_minute": round(statuses.get("succeeded", 0) / (figures["duration"] / 60), 2),
        "faults": dict(Counter(f.kind for f in faults)),
        "recovered": len(recoveries),
        "not_recovered": [f"{f.kind} {f.target}" for f in faults if f.seconds is None],
        "recovery_seconds": {
            "median": round(statistics.median(recoveries), 2) if recoveries else None,
            "worst": round(max(recoveries), 2) if recoveries else None,
        },
        "fault_log": [
            {"kind": f.kind, "target": f.target, "seconds": f.seconds and round(f.seconds, 2), "note": f.note}
            for f in faults
        ],
        **requests,
        "problems": {k: v[:20] for k, v in problems.items() if v},
    }


if __name__ == "__main__":
    sys.exit(main())
