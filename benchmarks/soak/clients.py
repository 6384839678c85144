"""The soak's tenants: a thread a project, each doing what a user's script does, in a seeded order:
upload and create jobs of the three methods (each with an Idempotency-Key, as a careful script
does), chat (whole and streamed), run grader dry runs, evaluate a finished job, poll.

Every request goes through ``Client.call``: a refused connection, a 429, a 502-504 is retried (after
``Retry-After`` where it says, on the other API process where the connection failed) until it gets an
answer or 90 s pass. Each request's attempts are kept: the checks need every request answered, and
each 5xx's time, to tell the ones inside a fault's window from the ones outside."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RETRYABLE = {429, 502, 503, 504}
JOB_STEPS = {"reinforcement": {"batch_size": 4, "rloo_k": 2, "n_epochs": 1, "max_new_tokens": 4}}
GRADER = {
    "type": "string_check",
    "name": "exact",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "eq",
}


@dataclass
class Request:
    what: str
    started: float
    statuses: list[tuple[float, int]] = field(default_factory=list)  # (time, status); 0: no answer
    answered: bool = False


@dataclass
class Tenant:
    name: str
    key: str
    jobs: dict[str, str] = field(default_factory=dict)  # job id -> its Idempotency-Key
    keys_sent: set[str] = field(default_factory=set)


class Client:
    """One tenant's requests, over the two API processes in turn."""

    GIVE_UP = 90.0

    def __init__(self, urls: list[str], tenant: Tenant, log: list[Request], lock: threading.Lock) -> None:
        self.urls, self.tenant, self.log, self.lock = urls, tenant, log, lock
        self.turn = 0

    def call(self, what: str, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        request = Request(what, time.time())
        with self.lock:
            self.log.append(request)
        headers = {"Authorization": f"Bearer {self.tenant.key}", **kwargs.pop("headers", {})}
        while time.time() - request.started < self.GIVE_UP:
            url = self.urls[self.turn % len(self.urls)]
            try:
                resp = httpx.request(method, url + path, headers=headers, timeout=60, **kwargs)
            except httpx.HTTPError:
                request.statuses.append((time.time(), 0))
                self.turn += 1  # the other API process
                time.sleep(0.5)
                continue
            request.statuses.append((time.time(), resp.status_code))
            if resp.status_code not in RETRYABLE:
                request.answered = True
                return resp
            time.sleep(min(5.0, float(resp.headers.get("retry-after", "1"))))
        return None

    def stream_chat(self) -> None:
        request = Request("chat stream", time.time())
        with self.lock:
            self.log.append(request)
        body = {
            "model": "tiny-policy",
            "messages": [{"role": "user", "content": "1+1="}],
            "max_tokens": 4,
            "stream": True,
        }
        while time.time() - request.started < self.GIVE_UP:
            url = self.urls[self.turn % len(self.urls)]
            try:
                with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                                  headers={"Authorization": f"Bearer {self.tenant.key}"}) as resp:  # fmt: skip
                    request.statuses.append((time.time(), resp.status_code))
                    if resp.status_code not in RETRYABLE:
                        text = "".join(resp.iter_text())
                        request.answered = resp.status_code != 200 or "[DONE]" in text or '"error"' in text
                        return
            except httpx.HTTPError:
                request.statuses.append((time.time(), 0))
                self.turn += 1
            time.sleep(1.0)


def run_tenant(client: Client, rng: random.Random, stop: threading.Event, *, new_jobs: threading.Event) -> None:
    """The tenant's loop until ``stop``; jobs only while ``new_jobs`` is set."""
    methods = ["reinforcement", "supervised", "dpo"]
    while not stop.is_set():
        op = rng.choices(["job", "chat", "stream", "dry_run", "evaluate", "poll"], [3, 3, 2, 2, 1, 3])[0]
        if op == "job" and new_jobs.is_set():
            create_job(client, rng.choice(methods))
        elif op == "chat":
            ask = {"model": "tiny-policy", "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 4}
            client.call("chat", "POST", "/v1/chat/completions", json=ask)
        elif op == "stream":
            client.stream_chat()
        elif op == "dry_run":
            item = {"prompt": "x", "answer": "4"}
            client.call("dry run", "POST", "/v1/fine_tuning/alpha/graders/run",
                        json={"grader": GRADER, "model_sample": "4", "item": item})  # fmt: skip
        elif op == "evaluate":
            evaluate_one(client, rng)
        elif op == "poll" and client.tenant.jobs:
            client.call("poll", "GET", f"/v1/fine_tuning/jobs/{rng.choice(sorted(client.tenant.jobs))}")
        stop.wait(rng.uniform(0.3, 1.5))


def create_job(client: Client, method: str) -> None:
    folder = {"reinforcement": "demo"}.get(method, method)
    spec = json.loads((EXAMPLES / folder / "job.json").read_text())
    data = (EXAMPLES / folder / "train.jsonl").read_bytes()
    upload_key = f"upload-{uuid.uuid4().hex}"
    resp = client.call("upload", "POST", "/v1/files", headers={"Idempotency-Key": upload_key},
                       files={"file": ("train.jsonl", data)}, data={"purpose": "fine-tune"})  # fmt: skip
    if resp is None or resp.status_code != 200:
        return  # a refusal (the storage quota) is an answer; nothing to train on
    spec["training_file"] = resp.json()["id"]
    spec.pop("validation_file", None)
    hp = spec["method"][method]["hyperparameters"]
    hp.update({"n_epochs": 1, "batch_size": 4, **JOB_STEPS.get(method, {})})
    key = f"job-{uuid.uuid4().hex}"
    spec["metadata"] = {"soak_key": key}
    client.tenant.keys_sent.add(key)
    resp = client.call("create job", "POST", "/v1/fine_tuning/jobs", json=spec, headers={"Idempotency-Key": key})
    if resp is not None and resp.status_code == 200:
        client.tenant.jobs[resp.json()["id"]] = key


def evaluate_one(client: Client, rng: random.Random) -> None:
    resp = client.call("list jobs", "GET", "/v1/fine_tuning/jobs?limit=50")
    if resp is None or resp.status_code != 200:
        return
    done = [j for j in resp.json()["data"] if j["status"] == "succeeded" and j["method"]["type"] == "reinforcement"]
    if done:
        job = rng.choice(done)
        client.call("evaluate", "POST", f"/v1/fine_tuning/jobs/{job['id']}/evaluations",
                    json={"file": job["training_file"], "checkpoints": [], "samples": 4})  # fmt: skip
