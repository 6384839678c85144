"""The soak's faults, on a seeded schedule: each kills or cuts one part, brings it back, and waits
until the stack answers as before (its recovery, timed). A fault's window runs from its injection to
that recovery: requests answered 5xx inside one are the fault's; outside any, they are bugs."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.soak.stack import SoakStack

KINDS = (
    "kill_training_worker",
    "kill_pool_process",
    "kill_api",
    "kill_inference_worker",
    "kill_graders_worker",
    "restart_redis",
    "cut_database",
    "fill_quota",
)
RECOVERY_LIMIT = 180.0


@dataclass
class Fault:
    kind: str
    target: str
    started: float
    recovered: float | None = None
    note: str = ""

    @property
    def seconds(self) -> float | None:
        return None if self.recovered is None else self.recovered - self.started


class Injector:
    def __init__(self, stack: SoakStack, operator_key: str, quota_tenant: tuple[str, str]) -> None:
        self.stack, self.operator_key = stack, operator_key
        self.quota_project, self.quota_key = quota_tenant

    def inject(self, kind: str, rng: random.Random) -> Fault:
        fault = getattr(self, kind)(rng)
        self._wait(fault, self._probe(kind, fault))
        return fault

    # Each fault -----------------------------------------------------------------------------------
    def kill_training_worker(self, rng: random.Random) -> Fault:
        return self._kill_and_start("kill_training_worker", rng.choice(["train-1", "train-2"]), rng.uniform(0.5, 3.0))

    def kill_pool_process(self, rng: random.Random) -> Fault:
        name = rng.choice(["train-1", "train-2"])
        children = self.stack.children(name)
        fault = Fault("kill_pool_process", name, time.time())
        # The worker's children: its reconciler (the first), and its pool process (the newest).
        if len(children) > 1:
            os.kill(children[-1], signal.SIGKILL)
            fault.note = f"pid {children[-1]}"
        else:
            fault.note = "no pool process: nothing to kill"
        return fault

    def kill_api(self, rng: random.Random) -> Fault:
        return self._kill_and_start("kill_api", rng.choice(["api-1", "api-2"]), rng.uniform(0.2, 2.0))

    def kill_inference_worker(self, rng: random.Random) -> Fault:
        return self._kill_and_start("kill_inference_worker", "serve", 0.0)

    def kill_graders_worker(self, rng: random.Random) -> Fault:
        return self._kill_and_start("kill_graders_worker", "graders", 0.0)

    def _kill_and_start(self, kind: str, name: str, pause: float) -> Fault:
        """SIGKILL to the process and its children, ``pause`` seconds down, then started again."""
        fault = Fault(kind, name, time.time())
        self.stack.kill(name)
        time.sleep(pause)
        self.stack.start(name)
        return fault

    def restart_redis(self, rng: random.Random) -> Fault:
        fault = Fault("restart_redis", "redis", time.time())
        self.stack.kill_redis()  # its data gone with it (no persistence): queues, leases, limits
        time.sleep(rng.uniform(0.5, 3.0))
        self.stack.start_redis()
        return fault

    def cut_database(self, rng: random.Random) -> Fault:
        fault = Fault("cut_database", "postgresql", time.time())
        self.stack.proxy.cut()
        time.sleep(rng.uniform(2.0, 6.0))
        self.stack.proxy.restore()
        return fault

    def fill_quota(self, rng: random.Random) -> Fault:
        """The quota tenant's storage quota set to what it stores: its uploads are refused (403
        quota_exceeded, nothing stored) for a few seconds, then the quota is lifted."""
        fault = Fault("fill_quota", self.quota_project, time.time())
        usage = self._operator("GET", f"/v1/usage?project_id={self.quota_project}").json()
        self._operator(
            "POST", f"/v1/projects/{self.quota_project}", json={"quotas": {"stored_bytes": usage["stored_bytes"]}}
        )
        refused = httpx.post(
            self.stack.url("api-1") + "/v1/files",
            headers={"Authorization": f"Bearer {self.quota_key}"},
            files={"file": ("x.jsonl", b'{"prompt": "p", "answer": "a"}\n')},
            data={"purpose": "fine-tune"},
            timeout=30,
        )
        fault.note = f"upload at the quota: {refused.status_code} {refused.json().get('error', {}).get('code')}"
        time.sleep(rng.uniform(2.0, 5.0))
        self._operator("POST", f"/v1/projects/{self.quota_project}", json={"quotas": {"stored_bytes": None}})
        return fault

    # Recovery -------------------------------------------------------------------------------------
    def _operator(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        deadline = time.monotonic() + 60
        while True:
            for api in ("api-1", "api-2"):
                try:
                    resp = httpx.request(
                        method, self.stack.url(api) + path, headers={"Authorization": f"Bearer {self.operator_key}"},
                        timeout=30, **kwargs,
                    )  # fmt: skip
                    if resp.status_code < 500:
                        return resp
                except httpx.HTTPError:
                    pass
            assert time.monotonic() < deadline, f"the operator's {method} {path} got no answer"
            time.sleep(0.5)

    def _probe(self, kind: str, fault: Fault) -> Callable[[], bool]:
        def apis() -> bool:
            return all(self.stack.healthy(api) for api in ("api-1", "api-2"))

        def jobs_beat() -> bool:
            """Every running job's holder beat since the fault: a job the fault orphaned was found, queued
            again and taken by a live worker (or ended)."""
            from sqlalchemy import select

            from service.core.tables import Job

            with self.stack.session() as session:
                beats = session.scalars(select(Job.heartbeat_at).where(Job.status == "running")).all()
            return all((beat or 0) > fault.started + 1 for beat in beats)

        def fleet() -> bool:
            """Both training workers registered and beating, the restarted one anew, and the jobs held."""
            workers = self._operator("GET", "/v1/workers").json()["data"]
            fresh = any(w["live"] and w["started_at"] >= int(fault.started) for w in workers)
            live = sum(1 for w in workers if w["live"])
            return apis() and live >= 2 and (fresh or kind != "kill_training_worker") and jobs_beat()

        def chat() -> bool:
            body = {"model": "tiny-policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            return apis() and self._operator("POST", "/v1/chat/completions", json=body).status_code == 200

        def dry_run() -> bool:
            body = {"grader": {"type": "string_check", "name": "x", "input": "a", "reference": "a", "operation": "eq"},
                    "model_sample": "a", "item": {}}  # fmt: skip
            return apis() and self._operator("POST", "/v1/fine_tuning/alpha/graders/run", json=body).status_code == 200

        return {
            "kill_training_worker": fleet,
            "kill_pool_process": fleet,
            "kill_inference_worker": chat,
            "kill_graders_worker": dry_run,
            "restart_redis": lambda: chat() and dry_run(),
        }.get(kind, apis)

    def _wait(self, fault: Fault, probe: Callable[[], bool]) -> None:
        while time.time() - fault.started < RECOVERY_LIMIT:
            try:
                if probe():
                    fault.recovered = time.time()
                    return
            except (httpx.HTTPError, AssertionError, ValueError, KeyError):
                pass
            time.sleep(0.25)
