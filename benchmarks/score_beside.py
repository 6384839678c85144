"""Scoring that waits on another process, beside the reference forward or not
(``python -m benchmarks.run score_beside``).

On the *small* policy with the engine's settings (k = 4, 8 prompts, 32 new tokens, KL 0.05 in the
reward, so a reference forward a step), ``STEPS`` steps a case, the medians over steps 3 on of
``time_score``, ``time_reference`` and ``time_step``:

* ``http_beside`` / ``http_inline``: an ``http`` grader whose endpoint (a thread of this process that
  sleeps, so it takes no CPU) answers after ``LATENCY_MS``: a stand-in for a scorer elsewhere (a
  reward model on another GPU, a service). Beside (the loop's choice for such a grader) against
  inline (the loop made to score first, then run the reference). The step should save about the
  smaller of the two phases.
* ``rm_local`` / ``rm_remote``: a reward model of the policy's shape scored beside the policy, and
  the same model served by a real inference worker process on this host (``"remote": true``, through
  an embedded Redis). On one CPU host the two processes share its 2 cores, so this measures the
  round trip and the overlap's net effect here, not what a second GPU would give.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, ours, plain_prompts

STEPS = 12
LATENCY_MS = 100
PHASES = ("time_score", "time_reference", "time_step")
SMALL = {"hidden_size": 256, "num_layers": 4}


def _split(steps: list[dict[str, Any]]) -> dict[str, float]:
    timed = steps[2:]  # the first steps include warm-up
    return {p.removeprefix("time_"): round(1000 * statistics.median(m[p] for m in timed), 1) for p in PHASES}


@contextmanager
def _endpoint(latency_s: float) -> Iterator[str]:
    """A scoring endpoint that answers each batch (the completions' lengths) after ``latency_s``."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(latency_s)
            data = json.dumps({"scores": [len(s["sample"]["output_text"]) / 32 for s in body["samples"]]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/score"
    finally:
        server.shutdown()


def _http_cases(models: Path, data: Path, tmp: Path) -> dict[str, Any]:
    import worker.engine.methods.rloo as train_mod
    from service.core.settings import get_settings

    out: dict[str, Any] = {}
    with _endpoint(LATENCY_MS / 1000) as url:
        os.environ["RLOO_HTTP_GRADER_URLS"] = json.dumps([url])
        get_settings.cache_clear()
        grader = {"type": "http", "name": "far", "url": url}
        real = train_mod.scored_elsewhere
        for case, beside in (("http_beside", True), ("http_inline", False)):
            train_mod.scored_elsewhere = lambda g, on=beside: on  # type: ignore[assignment]
            try:
                run = ours(models, "small", data, tmp / case, steps=STEPS, grader=grader)
            finally:
                train_mod.scored_elsewhere = real  # type: ignore[assignment]
            out[case] = _split(run["steps"])
    return out


def _rm_cases(models: Path, data: Path, tmp: Path) -> dict[str, Any]:
    """The reward model beside the policy, then served by an inference worker process."""
    from service.core.settings import Settings, get_settings
    from service.infra import embedded_redis

    home = tmp / "home"
    env = {"RLOO_HOME": str(home), "RLOO_MODELS_DIR": str(models), "DATABASE_URL": f"sqlite:///{home / 'rloo.db'}"}
    os.environ.update(env)
    get_settings.cache_clear()
    from service.core.db import reset_caches
    from service.core.migrate import upgrade

    reset_caches()
    upgrade()
    redis = embedded_redis.start(Settings(), daemonize=False)
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "worker", "--serve"],
        env={**os.environ, **env},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_for_a_worker(120)
        out: dict[str, Any] = {}
        for case, remote in (("rm_local", False), ("rm_remote", True)):
            grader = {"type": "reward_model", "name": "rm", "model": "small-reward", "remote": remote}
            out[case] = _split(ours(models, "small", data, tmp / case, steps=STEPS, grader=grader)["steps"])
        return out
    finally:
        os.killpg(worker.pid, 15)
        worker.wait(timeout=30)
        if redis is not None:
            redis.terminate()


def _wait_for_a_worker(seconds: float) -> None:
    """Until an inference worker has registered (its heartbeat in Redis)."""
    import redis

    from service.core.settings import get_settings
    from service.infra import inference_bus

    conn = redis.Redis.from_url(get_settings().redis_client_url)
    ns = inference_bus.namespace(inference_bus.serve_queue())
    deadline = time.monotonic() + seconds
    while not conn.zcount(f"{ns}:workers", time.time(), "+inf"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no inference worker registered within {seconds:g} s")
        time.sleep(0.5)


def main() -> int:
    from worker.tiny.models import build_tiny_causal_lm, build_tiny_reward_model

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        models = tmp / "models"
        build_tiny_causal_lm(models / "small", seed=0, **SMALL)
        build_tiny_reward_model(models / "small-reward", tokenizer_from=models / "small", seed=1, **SMALL)
        data = plain_prompts(tmp)
        out = {"latency_ms": LATENCY_MS, "steps": STEPS, **_http_cases(models, data, tmp)}
        out.update(_rm_cases(models, data, tmp))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
