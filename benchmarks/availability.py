"""One tenant against the rest (``python -m benchmarks.availability``; ``make bench``'s
``availability``): another project's latency while a hostile project attacks the shared parts.

The whole local stack (``rloo up``'s processes: the API, a training worker, the graders worker, an
inference worker, embedded Redis and SQLite) on loopback, a *tiny* model, two projects. The victim
probes, one request after another each: a list call (``GET /v1/files``), a 4-token chat, and a
``string_check`` dry run. Idle first, then while each attack runs, ``SECONDS`` each:

* ``webhook_tests``: 45 concurrent test events to an endpoint that sends its status line a byte
  every 3 s, again and again;
* ``webhook_deliveries``: 300 deliveries due to a receiver that never answers, the victim's own
  deliveries due after them (their delay is ``victim_delivery_delay_s``);
* ``json_bomb``: four 8 MB bodies of 2.7 million empty objects at once, again and again;
* ``dry_run_trickle``: http-grader dry runs against an endpoint trickling its status line, with
  ``timeout_seconds: 1``;
* ``prefill_1024_rows``: 64 prompts of ~240 tokens, ``n: 16``, ``max_tokens: 1``, 8 at once;
* ``heavy_allowed``: 8 at once of the most a request may ask (32 completions of 64 tokens);
* ``oversized_prompt``: 7.9 MB user messages, 4 at once;
* ``merged_exports``: 42 concurrent ``?merged=true`` downloads of a LoRA checkpoint;
* ``slow_evaluation``: an evaluation of 2,000 lines whose http grader takes 6 s a chunk.

Then ``training_turns``: three 30-step jobs of the attacker queued, then a 2-step job of the
victim's: how long the victim's waits to start.

Each phase runs on a fresh stack. The attacker's clients run in a process of their own at nice 19:
they share the two cores with the stack (as a remote attacker would not), but never take the
probes' turns.

Prints one JSON object: per phase, p50 and p99 (ms) and the count of each probe, and its p99
against idle; the target is within 2x of idle. The machine's two cores are shared by every process
of the stack, the attacker's clients and the probes: figures move by a fifth between runs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks.common import DEMO_DATA, build, job_row

ROOT = Path(__file__).resolve().parent.parent
SECONDS = 20.0
MODEL = "tiny"
STRING_CHECK = {
    "type": "string_check",
    "name": "s",
    "input": "{{sample.output_text}}",
    "reference": "a",
    "operation": "eq",
}


# The attacker's receivers, on loopback -----------------------------------------------------------------
class Raw:
    """A TCP server whose every connection runs ``behave(conn)``."""

    def __init__(self, behave: Callable[[socket.socket], None]) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/"

        def loop() -> None:
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                threading.Thread(target=self._one, args=(behave, conn), daemon=True).start()

        threading.Thread(target=loop, daemon=True).start()

    @staticmethod
    def _one(behave: Callable[[socket.socket], None], conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            behave(conn)
        conn.close()


def trickle(every: float) -> Callable[[socket.socket], None]:
    def behave(conn: socket.socket) -> None:
        conn.recv(65536)
        for byte in b'HTTP/1.1 200 OK\r\nContent-Length: 14\r\n\r\n{"scores":[0]}':
            conn.sendall(bytes([byte]))
            time.sleep(every)

    return behave


def silent(conn: socket.socket) -> None:
    while conn.recv(65536):
        pass


class Arrivals(BaseHTTPRequestHandler):
    """The victim's webhook receiver: when each delivery (by its job id) arrived."""

    got: dict[str, float] = {}

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Arrivals.got[body["data"]["id"]] = time.time()
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


class SlowGrader(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["samples"])
        time.sleep(6.0)
        body = json.dumps({"scores": [0.5] * n}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/"


# Probes and attacks -------------------------------------------------------------------------------------
def _percentiles(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"n": 0}
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": round(1000 * statistics.median(ordered), 1),
        "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
    }


def _loop(stop: threading.Event, fn: Callable[[], Any]) -> None:
    """``fn`` again and again until ``stop``; a 429 waited out as the openai SDK waits it out."""
    while not stop.is_set():
        try:
            r = fn()
        except Exception:
            continue
        if r.status_code == 429:
            time.sleep(float(r.headers.get("Retry-After", "1")))


def probes(http: Any, stop: threading.Event) -> dict[str, list[float]]:
    """The victim's three requests, each one after another, until ``stop``: their latencies."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    dry = {"grader": STRING_CHECK, "model_sample": "a", "item": {}}
    kinds = {
        "list": lambda: http.get("/files", timeout=120),
        "chat": lambda: http.post("/chat/completions", json=chat, timeout=300),
        "dry_run": lambda: http.post("/fine_tuning/alpha/graders/run", json=dry, timeout=300),
    }
    out: dict[str, list[float]] = {k: [] for k in kinds}

    def run(kind: str) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            with contextlib.suppress(Exception):  # a time-out is a latency too
                kinds[kind]()
            out[kind].append(time.perf_counter() - t0)
            time.sleep(0.05)

    threads = [threading.Thread(target=run, args=(k,)) for k in kinds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


Load = dict[str, Any]
"""Requests the attacker's process sends, each of its ``threads`` one after another: ``method``,
``path``, and a ``json`` body or the bytes of ``content_path``."""


def attack(spec_path: str) -> None:
    """The attacker's process (``--attack SPEC``): its loads until it is stopped."""
    import httpx

    spec = json.loads(Path(spec_path).read_text())
    http = httpx.Client(base_url=spec["base_url"], headers={"Authorization": f"Bearer {spec['key']}"}, timeout=300)
    for load in spec["loads"]:
        kwargs: dict[str, Any] = {"json": load["json"]} if "json" in load else {}
        if "content_path" in load:
            kwargs = {
                "content": Path(load["content_path"]).read_bytes(),
                "headers": {"Content-Type": "application/json"},
            }
        send = functools.partial(http.request, load["method"], load["path"], **kwargs)
        for _ in range(load["threads"]):
            threading.Thread(target=_loop, args=(threading.Event(), send), daemon=True).start()
    threading.Event().wait()


class Bench:
    def __init__(self, home: Path, stack_url: str, keys: dict[str, str], hosts: dict[str, str]) -> None:
        import httpx

        self.home, self.hosts, self.keys = home, hosts, keys
        self.attacker = httpx.Client(
            base_url=stack_url + "/v1", headers={"Authorization": f"Bearer {keys['attacker']}"}
        )
        self.victim = httpx.Client(base_url=stack_url + "/v1", headers={"Authorization": f"Bearer {keys['victim']}"})
        self.files = {who: self._upload(c) for who, c in (("attacker", self.attacker), ("victim", self.victim))}

    @staticmethod
    def _upload(http: Any, data: bytes | None = None) -> str:
        data = data if data is not None else DEMO_DATA.read_bytes()
        files = {"file": ("d.jsonl", data)}
        return str(call(http, "POST", "/files", files=files, data={"purpose": "fine-tune"})["id"])

    def phase(self, attack: Callable[[], list[Load]] | None) -> dict[str, Any]:
        """The victim's probes for ``SECONDS``, while ``attack``'s loads run in the attacker's process."""
        attacker = self._attacker(attack()) if attack else None
        try:
            time.sleep(3.0 if attack else 0)  # the attack under way
            probing = threading.Event()
            result: dict[str, Any] = {}
            prober = threading.Thread(target=lambda: result.update(probes(self.victim, probing)))
            prober.start()
            time.sleep(SECONDS)
            probing.set()
            prober.join()
        finally:
            if attacker is not None:
                attacker.terminate()
                attacker.wait(timeout=30)
            _end_evaluations()
        return {kind: _percentiles(samples) for kind, samples in result.items()}

    def _attacker(self, loads: list[Load]) -> subprocess.Popen[bytes]:
        """The attacker's clients in a process of their own at the lowest CPU priority: they share
        the machine's cores with the stack, as they would not from elsewhere, but never take the
        probes' turns (nor, in one process, their interpreter's lock)."""
        spec = self.home / "attack.json"
        spec.write_text(
            json.dumps({"base_url": str(self.attacker.base_url), "key": self.keys["attacker"], "loads": loads})
        )
        return subprocess.Popen(
            [sys.executable, "-m", "benchmarks.availability", "--attack", str(spec)],
            cwd=Path.cwd(),
            preexec_fn=lambda: os.nice(19),  # noqa: PLW1509 (no threads yet in this child)
        )

    # The attacks: each sets up what it needs, then names the requests its process sends over and over
    def _endpoint(self, url: str, types: list[str]) -> str:
        body = {"name": "a", "url": url + "h", "event_types": types}
        return str(call(self.attacker, "POST", "/webhook_endpoints", json=body)["id"])

    def _body_file(self, name: str, text: str) -> str:
        path = self.home / name
        path.write_text(text)
        return str(path)

    def webhook_tests(self) -> list[Load]:
        endpoint = self._endpoint(self.hosts["trickle"], ["fine_tuning.job.succeeded"])
        return [{"threads": 45, "method": "POST", "path": f"/webhook_endpoints/{endpoint}/test", "json": {}}]

    def json_bomb(self) -> list[Load]:
        body = self._body_file("bomb.json", '{"x": [' + ",".join(["{}"] * 2_700_000) + "]}")
        return [{"threads": 4, "method": "POST", "path": "/completions", "content_path": body}]

    def dry_run_trickle(self) -> list[Load]:
        grader = {"type": "http", "name": "t", "url": self.hosts["grader_trickle"] + "g", "timeout_seconds": 1}
        body = {"grader": grader, "model_sample": "a", "item": {}}
        return [{"threads": 4, "method": "POST", "path": "/fine_tuning/alpha/graders/run", "json": body}]

    def prefill_1024_rows(self) -> list[Load]:
        body = {"model": MODEL, "prompt": ["the cat sat on the mat " * 40] * 64, "n": 16, "max_tokens": 1}
        return [{"threads": 8, "method": "POST", "path": "/completions", "json": body}]

    def heavy_allowed(self) -> list[Load]:
        body = {"model": MODEL, "prompt": ["the cat sat on the mat " * 8] * 8, "n": 3, "max_tokens": 64}
        return [{"threads": 8, "method": "POST", "path": "/completions", "json": body}]

    def oversized_prompt(self) -> list[Load]:
        message = {"role": "user", "content": "word " * 1_580_000}
        body = self._body_file("big.json", json.dumps({"model": MODEL, "messages": [message], "max_tokens": 1}))
        return [{"threads": 4, "method": "POST", "path": "/chat/completions", "content_path": body}]

    def merged_exports(self) -> list[Load]:
        job_id, ckpt_id = lora_checkpoint(self.home, "attacker")
        url = f"/fine_tuning/jobs/{job_id}/checkpoints/{ckpt_id}/content?merged=true"
        return [{"threads": 42, "method": "GET", "path": url}]

    def slow_evaluation(self) -> list[Load]:
        lines = DEMO_DATA.read_text().splitlines()
        file_id = self._upload(self.attacker, ("\n".join((lines * (2000 // len(lines) + 1))[:2000]) + "\n").encode())
        job = call(self.attacker, "POST", "/fine_tuning/jobs", json=_job(self.files["attacker"], steps=2))
        call(self.attacker, "POST", f"/fine_tuning/jobs/{job['id']}/cancel")
        grader = {"type": "http", "name": "slow", "url": self.hosts["slow_grader"] + "g", "timeout_seconds": 30}
        body = {"file": file_id, "checkpoints": [], "samples": 2000, "max_tokens": 4, "grader": grader}
        call(self.attacker, "POST", f"/fine_tuning/jobs/{job['id']}/evaluations", json=body)
        return []  # the evaluation is the attack; the phase's end stops it

    def webhook_deliveries(self) -> dict[str, Any]:
        """The attacker's 300 deliveries to a receiver that never answers, due before the victim's 5."""
        endpoint = self._endpoint(self.hosts["silent"], ["fine_tuning.job.succeeded"])
        r = self.victim.post(
            "/webhook_endpoints",
            json={"name": "v", "url": self.hosts["arrivals"] + "h", "event_types": ["fine_tuning.job.succeeded"]},
        )
        r.raise_for_status()
        due = _deliveries(endpoint, r.json()["id"], 300, 5)
        deadline = time.time() + 300
        while len(Arrivals.got) < 5 and time.time() < deadline:
            time.sleep(0.1)
        delays = [Arrivals.got.get(f"ftjob-v{i}", deadline) - due for i in range(5)]
        return {
            "victim_delivery_delay_s": {"median": round(statistics.median(delays), 2), "max": round(max(delays), 2)}
        }

    def training_turns(self) -> dict[str, Any]:
        """Three 30-step jobs of the attacker's queued, then the victim's 2-step job: its wait."""
        for _ in range(3):
            call(self.attacker, "POST", "/fine_tuning/jobs", json=_job(self.files["attacker"], steps=30))
        t0 = time.time()
        job = self.victim.post("/fine_tuning/jobs", json=_job(self.files["victim"], steps=2)).json()
        while job["status"] == "queued" and time.time() - t0 < 900:
            time.sleep(0.5)
            job = self.victim.get(f"/fine_tuning/jobs/{job['id']}").json()
        return {"victim_job_wait_s": round(time.time() - t0, 1), "victim_job_status": job["status"]}


def call(http: Any, method: str, url: str, **kwargs: Any) -> Any:
    """A setup request of the attacker's, waiting out its key's rate limit (its attack spent it)."""
    for _ in range(120):
        r = http.request(method, url, timeout=120, **kwargs)
        if r.status_code != 429:
            r.raise_for_status()
            return r.json()
        time.sleep(float(r.headers.get("Retry-After", "1")))
    raise RuntimeError(f"{method} {url}: rate limited for two minutes")


def _job(file_id: str, *, steps: int) -> dict[str, Any]:
    spec = json.loads((ROOT / "examples" / "demo" / "job.json").read_text())
    spec.update(model=MODEL, training_file=file_id)
    spec["method"]["reinforcement"]["hyperparameters"].update(max_steps=steps, checkpoint_interval=0)
    return dict(spec)


def _deliveries(attacker_endpoint: str, victim_endpoint: str, theirs: int, ours: int) -> float:
    """Rows in the outbox as state changes would write them: the attacker's due first. When the
    victim's were due."""
    from service.core.db import session_scope
    from service.core.tables import WebhookDelivery, WebhookEndpoint
    from service.jobs import webhooks

    with session_scope() as session:
        seq = {e.id: e.seq for e in session.query(WebhookEndpoint)}
        t = time.time()
        for i in range(theirs):
            payload = webhooks.event("fine_tuning.job.succeeded", f"ftjob-a{i}")
            session.add(
                WebhookDelivery(
                    endpoint_seq=seq[attacker_endpoint],
                    event_type=payload["type"],
                    payload=payload,
                    next_attempt_at=t - 10,
                )
            )
        for i in range(ours):
            payload = webhooks.event("fine_tuning.job.succeeded", f"ftjob-v{i}")
            session.add(
                WebhookDelivery(
                    endpoint_seq=seq[victim_endpoint], event_type=payload["type"], payload=payload, next_attempt_at=t
                )
            )
        session.commit()
    return t


def _end_evaluations() -> None:
    from service.core.db import session_scope
    from service.core.tables import Evaluation

    with session_scope() as session:  # (the route to cancel one is new; this works on any release)
        session.query(Evaluation).filter(Evaluation.status.in_(("queued", "running"))).update({"status": "failed"})
        session.commit()


def lora_checkpoint(home: Path, project: str) -> tuple[str, str]:
    """A succeeded job of ``project`` with one LoRA checkpoint, saved as training saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from service.core.db import session_scope
    from service.core.settings import get_settings
    from service.core.tables import Checkpoint
    from service.registry import model_ids

    settings = get_settings()
    base = settings.models_dir / MODEL
    torch.manual_seed(5)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, init_lora_weights=False))
    with session_scope() as session:
        job = job_row(session, project, MODEL, status="succeeded")
        path = settings.artifacts_dir / "checkpoints" / job.id / "step-1"
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(base).save_pretrained(path)
        model_id = model_ids.model_id(base=MODEL, project=project, suffix=None, job_id=job.id)
        ckpt = Checkpoint(
            job_seq=job.seq,
            step_number=1,
            path=str(path.relative_to(settings.artifacts_dir)),
            fine_tuned_model_checkpoint=model_ids.checkpoint_id(model_id, 1),
        )
        session.add(ckpt)
        session.commit()
        return job.id, ckpt.id


@contextlib.contextmanager
def stack(home: Path, env: dict[str, str]) -> Iterator[Any]:
    for name in ("DATABASE_URL", "RLOO_DATABASE_URL", "REDIS_URL", "RLOO_REDIS_URL", "RLOO_MODELS_DIR"):
        os.environ.pop(name, None)
    os.environ.update({"RLOO_HOME": str(home), **env})
    from service.core.db import reset_caches
    from worker.cli.stack import Stack

    reset_caches()  # this process's settings and engine follow the new home

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    running = Stack("127.0.0.1", port, quiet=True)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def warm_up(http: Any, timeout: float = 180) -> None:
    """Until the inference worker answers a chat (503 while it starts; the model loads on the first)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if http.post("/chat/completions", json=chat, timeout=120).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError("no inference worker answered")


def key(project: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "keys", "create", "--project", project],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ,
        cwd=ROOT,
    )
    return out.stdout.strip().splitlines()[-1]


PHASES = (
    "webhook_tests",
    "json_bomb",
    "dry_run_trickle",
    "prefill_1024_rows",
    "heavy_allowed",
    "oversized_prompt",
    "merged_exports",
    "slow_evaluation",
)


def main(phases: tuple[str, ...] = PHASES) -> dict[str, Any]:
    """Each phase on a stack of its own (fresh home, fresh processes): what one attack leaves behind
    (a thread still held, a queue still full) never shows in the next one's figures."""
    hosts = {
        "trickle": Raw(trickle(3.0)).url,
        "grader_trickle": Raw(trickle(0.5)).url,
        "silent": Raw(silent).url,
        "arrivals": serve(Arrivals),
        "slow_grader": serve(SlowGrader),
    }
    env = {
        "RLOO_WEBHOOK_URLS": json.dumps([hosts[k] for k in ("trickle", "silent", "arrivals")]),
        "RLOO_HTTP_GRADER_URLS": json.dumps([hosts[k] for k in ("grader_trickle", "slow_grader")]),
    }
    out: dict[str, Any] = {}
    for name in ("idle", *phases, "webhook_deliveries", "training_turns"):
        print(f"availability: {name}", file=sys.stderr, flush=True)
        home = Path(tempfile.mkdtemp(prefix="rloo-bench-availability-"))
        try:
            build(home / "models", MODEL)
            with stack(home, env) as running:
                bench = Bench(home, running.url, {"attacker": key("attacker"), "victim": key("victim")}, hosts)
                warm_up(bench.victim)
                if name in ("webhook_deliveries", "training_turns"):
                    out[name] = getattr(bench, name)()
                else:
                    out[name] = bench.phase(None if name == "idle" else getattr(bench, name))
        finally:
            shutil.rmtree(home, ignore_errors=True)
        for kind, figures in out[name].items():
            idle = out["idle"].get(kind, {}).get("p99_ms") if isinstance(figures, dict) else None
            if name != "idle" and idle and figures.get("p99_ms"):
                figures["p99_vs_idle"] = round(figures["p99_ms"] / idle, 2)
        print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)  # kept should a later phase fail
    out["config"] = (
        "rloo up's processes on loopback (SQLite, embedded Redis), tiny model, a fresh stack a phase; the "
        f"victim's probes one after another for {SECONDS:g} s a phase; p99 of n samples"
    )
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--attack"]:
        attack(sys.argv[2])
    else:
        print(json.dumps(main(tuple(sys.argv[1:]) or PHASES), indent=2))
