"""What the service costs around the engine: the same tiny job through HTTP + Redis + Celery + the
database, against ``rloo train`` in the foreground.

On the embedded defaults (SQLite, embedded Redis) in a fresh ``RLOO_HOME``, alternating, ``rounds``
times each:

* ``rloo train SPEC.json``: a process from start to exit (imports, model load, 40 steps, checkpoint);
* the same spec as a job: from the ``POST /v1/fine_tuning/jobs`` answer to ``succeeded``, polled;
  with submit-to-running latency (the job claimed by the worker) and submit-to-first-step.

Then what recording costs a step: the worker's ``DatabaseRecorder.step`` (metrics row, metrics event,
progress and the cancel/pause check, one transaction), timed on the same database, against the
median step time of the job. Prints one JSON object (``python -m benchmarks.service``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import DEMO_DATA, NEW_TOKENS, PROMPTS, STEPS, K, build, spec_hyperparameters

GRADER = {
    "type": "text_similarity",
    "name": "answer",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "evaluation_metric": "fuzzy_match",
}
HYPERPARAMETERS = spec_hyperparameters()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def foreground(spec: Path, home: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "worker.cli", "train", str(spec), "--output-dir", str(home / "fg")],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ,
    )
    wall = time.perf_counter() - t0
    shutil.rmtree(home / "fg", ignore_errors=True)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    steps = [m for m in lines if "time_step" in m]
    summary = next(m for m in reversed(lines) if "status" in m)
    return {
        "wall_s": wall,
        "train_s": summary["wall_s"],
        "time_step_median": statistics.median(m["time_step"] for m in steps),
    }


def through_service(http: Any, file_id: str) -> dict[str, Any]:
    method = {"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": HYPERPARAMETERS}}
    body = {"model": "tiny", "training_file": file_id, "seed": 0, "method": method}
    r = http.post("/fine_tuning/jobs", json=body)
    r.raise_for_status()
    t0 = time.perf_counter()
    job_id = r.json()["id"]
    running = first_step = None
    while True:
        job = http.get(f"/fine_tuning/jobs/{job_id}").json()
        now = time.perf_counter()
        if running is None and job["status"] != "queued":
            running = now - t0
        if first_step is None and job["progress"]["step"] >= 1:
            first_step = now - t0
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.01 if first_step is None else 0.1)  # fine-grained only until the first step
    if job["status"] != "succeeded":
        raise RuntimeError(f"job {job_id} {job['status']}: {job['error']}")
    metrics = http.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"]
    events = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    ready = [re.search(r" ready on \w+ in ([\d.]+) s", e["message"]) for e in events]
    return {
        "job_id": job_id,
        "wall_s": now - t0,
        "submit_to_running_s": running,
        "submit_to_first_step_s": first_step,
        "model_ready_s": float(next(m for m in ready if m).group(1)),
        "time_step_median": statistics.median(m["time_step"] for m in metrics),
    }


def recording_cost(job_id: str, n: int = 200) -> dict[str, Any]:
    """``DatabaseRecorder.step`` on a finished job's row (set back to running for this), ``n`` times."""
    from service.core import crud
    from service.core.db import session_scope
    from service.core.tables import Job, JobMetric
    from worker.jobs.database_recorder import DatabaseRecorder

    with session_scope() as session:
        job = crud.get_job_by_id(session=session, job_id=job_id)
        assert job is not None
        row = session.query(JobMetric).filter(JobMetric.job_seq == job.seq, JobMetric.step == 1).one()
        metrics = dict(row.data)
        session.query(Job).filter(Job.seq == job.seq).update({"status": "running"})
        session.commit()
    recorder = DatabaseRecorder(job)
    times = []
    for i in range(n):
        step = STEPS + 1 + i
        t0 = time.perf_counter()
        recorder.step(step, {**metrics, "step": step, "total_steps": STEPS + n})
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"calls": n, "median_s": statistics.median(times), "p99_s": times[int(0.99 * (n - 1))]}


def main(rounds: int = 2) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="rloo-bench-service-"))
    # The embedded defaults in a fresh home, whatever this shell points at.
    for name in (
        "DATABASE_URL",
        "RLOO_DATABASE_URL",
        "REDIS_URL",
        "RLOO_REDIS_URL",
        "RLOO_MODELS_DIR",
        "RLOO_ARTIFACTS_DIR",
    ):
        os.environ.pop(name, None)
    os.environ["RLOO_HOME"] = str(home)
    # The stack's API inherits this: the poller asks every 10 ms until the first step, past the per-key
    # rate limit (20/s by default), and a 429 would blur the latencies measured here.
    os.environ["RLOO_RATE_LIMIT"] = "0"
    import httpx

    from worker.cli.stack import Stack

    try:
        build(home / "models", "tiny")
        spec_dir = home / "spec"
        spec_dir.mkdir()
        shutil.copy(DEMO_DATA, spec_dir / "train.jsonl")
        spec = spec_dir / "job.json"
        spec.write_text(
            json.dumps(
                {
                    "model": "tiny",
                    "training_file": "train.jsonl",
                    "seed": 0,
                    "method": {
                        "type": "reinforcement",
                        "reinforcement": {"grader": GRADER, "hyperparameters": HYPERPARAMETERS},
                    },
                }
            )
        )

        stack = Stack("127.0.0.1", _free_port(), quiet=True)
        key = stack.start()
        runs: dict[str, list[dict[str, Any]]] = {"rloo_train": [], "service": []}
        try:
            http = httpx.Client(base_url=stack.url + "/v1", headers={"Authorization": f"Bearer {key}"}, timeout=60)
            upload = http.post(
                "/files", files={"file": ("train.jsonl", DEMO_DATA.read_bytes())}, data={"purpose": "fine-tune"}
            )
            upload.raise_for_status()
            time.sleep(8)  # the worker's pool child preloads torch while idle, as it would between jobs
            for r in range(rounds):
                print(f"round {r + 1}: rloo train", file=sys.stderr, flush=True)
                runs["rloo_train"].append(foreground(spec, home))
                print(f"round {r + 1}: through the service", file=sys.stderr, flush=True)
                runs["service"].append(through_service(http, upload.json()["id"]))
                time.sleep(8)  # the next pool child preloads
        finally:
            stack.stop()
        record = recording_cost(runs["service"][-1]["job_id"])
    finally:
        shutil.rmtree(home, ignore_errors=True)

    def med(who: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[who]), 3)

    step = med("service", "time_step_median")
    return {
        "config": f"tiny, {STEPS} steps, k={K}, {PROMPTS} prompts, {NEW_TOKENS} new tokens; SQLite + embedded Redis, "
        f"one Celery worker; medians of {rounds} alternating rounds",
        "rloo_train_wall_s": med("rloo_train", "wall_s"),
        "rloo_train_in_train_s": med("rloo_train", "train_s"),
        "service_submit_to_succeeded_s": med("service", "wall_s"),
        # Against the whole foreground process (interpreter, imports, model load, steps): the worker has
        # its imports done before the job comes; against train() alone (model load and steps).
        "service_extra_s": round(med("service", "wall_s") - med("rloo_train", "wall_s"), 3),
        "service_extra_vs_train_s": round(med("service", "wall_s") - med("rloo_train", "train_s"), 3),
        "submit_to_running_s": med("service", "submit_to_running_s"),
        "submit_to_first_step_s": med("service", "submit_to_first_step_s"),
        "model_load_s": med("service", "model_ready_s"),
        "step_time_median_s": {"rloo_train": med("rloo_train", "time_step_median"), "service": step},
        "recording_per_step_s": {"median": round(record["median_s"], 5), "p99": round(record["p99_s"], 5)},
        "recording_share_of_step": round(record["median_s"] / step, 4),
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
