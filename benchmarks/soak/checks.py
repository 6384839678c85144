"""What the soak holds the stack to once the faults stop and the jobs end: read from the database (past
the proxy) and the artifacts directory. Each check returns the problems it found (none: it holds)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from benchmarks.soak.clients import Request, Tenant
from benchmarks.soak.faults import Fault

FINAL = {"succeeded", "failed", "cancelled"}
RESTARTS = ("queued again", "Job resumed")


def jobs_ended(session: Any) -> list[str]:
    from service.core.tables import Job

    return [f"{j.id} is {j.status} at step {j.step}" for j in session.scalars(select(Job)) if j.status not in FINAL]


def steps_once_and_checkpoints_load(session: Any, artifacts: Path) -> list[str]:
    """A succeeded job has a metric row for each step 1..total, once, and a final checkpoint that loads."""
    from transformers import AutoModelForCausalLM

    from service.core.tables import Checkpoint, Job, JobMetric

    problems = []
    for job in session.scalars(select(Job).where(Job.status == "succeeded")):
        steps = Counter(session.scalars(select(JobMetric.step).where(JobMetric.job_seq == job.seq)))
        if sorted(steps) != list(range(1, job.total_steps + 1)) or any(n != 1 for n in steps.values()):
            repeats = [s for s, n in steps.items() if n > 1]
            problems.append(f"{job.id}: steps {sorted(steps)[:5]}… of {job.total_steps}, repeats {repeats}")
        last = session.scalars(
            select(Checkpoint).where(Checkpoint.job_seq == job.seq).order_by(Checkpoint.step_number.desc())
        ).first()
        if last is None or last.step_number != job.total_steps:
            problems.append(f"{job.id}: no checkpoint of its last step")
            continue
        try:
            AutoModelForCausalLM.from_pretrained(artifacts / last.path)
        except Exception as exc:  # noqa: BLE001 (any reason it does not load is the finding)
            problems.append(f"{job.id}: its final checkpoint {last.path} does not load: {exc}")
    return problems


def one_worker_at_a_time(session: Any) -> list[str]:
    """Between two starts of a job, something ended the first: its worker's death found and the job
    queued again, or a pause and a resume."""
    from service.core.tables import Job, JobEvent

    problems = []
    for job in session.scalars(select(Job)):
        messages = session.scalars(select(JobEvent.message).where(JobEvent.job_seq == job.seq).order_by(JobEvent.seq))
        open_start = False
        for message in messages:
            if message == "Job started":
                if open_start:
                    problems.append(f"{job.id}: started again while its previous run had not ended")
                open_start = True
            elif any(r in message for r in RESTARTS):
                open_start = False
    return problems


def nothing_orphaned(session: Any, artifacts: Path) -> list[str]:
    """Each file and checkpoint row has its bytes, and every uploaded file or checkpoint directory on
    disk has its row."""
    from service.core.tables import Checkpoint, File

    problems = []
    files = {f.path for f in session.scalars(select(File))}
    checkpoints = {c.path for c in session.scalars(select(Checkpoint))}
    problems += [f"file row without its bytes: {p}" for p in sorted(files) if not (artifacts / p).is_file()]
    problems += [
        f"checkpoint row without its directory: {p}" for p in sorted(checkpoints) if not (artifacts / p).is_dir()
    ]
    on_disk = (
        {str(p.relative_to(artifacts)) for p in (artifacts / "files").rglob("*.jsonl")}
        if (artifacts / "files").is_dir()
        else set()
    )
    problems += [f"file on disk without a row: {p}" for p in sorted(on_disk - files)]
    return problems


def one_job_per_idempotency_key(session: Any, tenants: list[Tenant]) -> list[str]:
    from service.core.tables import Job

    seen = Counter((j.metadata_ or {}).get("soak_key") for j in session.scalars(select(Job)))
    sent = set().union(*(t.keys_sent for t in tenants))
    return [f"{n} jobs for Idempotency-Key {k}" for k, n in seen.items() if k and n > 1] + [
        f"a job for a key never sent: {k}" for k in seen if k and k not in sent
    ]


def usage_adds_up(session: Any) -> list[str]:
    """A job that trained has device-seconds metered, and at least the tokens it trained (a step run
    again after a crash is metered again: it ran again)."""
    from service.core.tables import Job, UsageRecord

    problems = []
    for job in session.scalars(select(Job).where(Job.step > 0)):
        used = dict(
            session.execute(
                select(UsageRecord.kind, func.sum(UsageRecord.amount))
                .where(UsageRecord.subject == job.id)
                .group_by(UsageRecord.kind)
            ).all()
        )
        if not used.get("device_seconds"):
            problems.append(f"{job.id}: {job.step} steps and no device-seconds metered")
        if (job.trained_tokens or 0) > used.get("tokens_trained", 0) + 1e-6:
            problems.append(f"{job.id}: trained {job.trained_tokens} tokens, metered {used.get('tokens_trained', 0)}")
    return problems


def requests_answered(log: list[Request], faults: list[Fault]) -> tuple[list[str], dict[str, int]]:
    """Every request got an answer (a retryable error converged on retry); 5xx inside a fault's
    window are counted apart from those outside one."""
    windows = [(f.started, f.recovered or f.started + 180) for f in faults]
    inside = outside = 0
    problems = []
    for r in log:
        if not r.answered:
            problems.append(f"{r.what} at {r.started:.0f}: never answered ({r.statuses[-3:]})")
        for at, status in r.statuses:
            if status >= 500:
                if any(a - 1 <= at <= b + 1 for a, b in windows):
                    inside += 1
                else:
                    outside += 1
                    problems.append(f"{r.what}: {status} at {at:.0f}, outside every fault's window")
    return problems, {"requests": len(log), "5xx_inside_faults": inside, "5xx_outside_faults": outside}
