"""The RLOO seed-0 job of the exact task through the HTTP API (a local stack on the embedded
defaults), its metrics against the same job's run in the benchmark's process, step by step."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from benchmarks.learning.tasks import EXAMPLE, JOB
from worker.engine.metrics import TIMING_METRICS


def through_api(reference: list[dict[str, Any]], overrides: dict[str, Any]) -> dict[str, Any]:
    """The seed-0 RLOO job (job.json, ``overrides`` on its hyperparameters) through HTTP on a local
    stack; its metrics against ``reference`` (the same job's in-process run): every step's every
    metric but the timings."""
    import httpx

    from worker.cli.stack import Stack

    os.environ["RLOO_RATE_LIMIT"] = "0"
    stack = Stack("127.0.0.1", _free_port(), quiet=True)
    key = stack.start()
    try:
        http = httpx.Client(base_url=stack.url + "/v1", headers={"Authorization": f"Bearer {key}"}, timeout=60)
        body = json.loads(JOB.read_text())
        for which in ("training_file", "validation_file"):
            path = EXAMPLE / body[which]
            r = http.post("/files", files={"file": (path.name, path.read_bytes())}, data={"purpose": "fine-tune"})
            r.raise_for_status()
            body[which] = r.json()["id"]
        body["method"]["reinforcement"]["hyperparameters"].update(overrides)
        r = http.post("/fine_tuning/jobs", json=body)
        r.raise_for_status()
        job_id = r.json()["id"]
        t0 = time.perf_counter()
        while (job := http.get(f"/fine_tuning/jobs/{job_id}").json())["status"] not in (
            "succeeded",
            "failed",
            "cancelled",
        ):
            if time.perf_counter() - t0 > 3600:
                raise RuntimeError(f"job {job_id} still {job['status']} after an hour")
            time.sleep(1)
        if job["status"] != "succeeded":
            raise RuntimeError(f"job {job_id} {job['status']}: {job['error']}")
        wall = time.perf_counter() - t0
        metrics = http.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"]
    finally:
        stack.stop()
    diffs: dict[str, float] = {}
    for api_row, ours_row in zip(metrics, reference, strict=True):
        for name, value in ours_row.items():
            if name in TIMING_METRICS or not isinstance(value, (int, float)):
                continue
            other = api_row.get(name)
            diff = abs(float(other) - float(value)) if isinstance(other, (int, float)) else math.inf
            diffs[name] = max(diffs.get(name, 0.0), diff)
    valid = [(m["step"], m["valid_reward_mean"]) for m in metrics if m.get("valid_reward_mean") is not None]
    return {
        "job_id": job_id,
        "steps": len(metrics),
        "submit_to_succeeded_s": round(wall, 1),
        "valid_reward_mean": valid,
        "metrics_compared": len(diffs),
        "largest_difference": max(diffs.values()) if diffs else None,
        "differing_metrics": sorted(name for name, d in diffs.items() if d > 0),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
