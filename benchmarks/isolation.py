"""What keeping tenants apart costs (``python -m benchmarks.isolation``; ``make bench``'s ``isolation``):

1. ``python_grader``: a batch of 64 samples of a one-line python grader, in bubblewrap's sandbox
   (as root it runs without a user namespace, and in one) and in the ``process`` sandbox: the
   median wall time of a batch, and of a one-sample batch (what a sandbox's start costs).
2. ``dry_run``: a ``string_check`` dry run through Redis and a real graders worker
   (``rloo worker --queue <queue>-graders``), from the API's side (``service.jobs.dry_runs.run``): latency
   percentiles of 60 in a row.
3. ``json_door``: ``service.core.strictjson.loads`` against ``json.loads`` on a job body and on a 1 MB
   dry-run body.
4. ``checkpoint_download``: a 256 MiB checkpoint directory: the first byte and the whole archive
   made while sent (``service.api.tarstream``), against copying it into a tar file first (what the
   download did before).

Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _median_s(fn: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_ms(fn: Any, rounds: int) -> float:
    return round(_median_s(fn, rounds) * 1000, 1)


def python_grader() -> dict[str, Any]:
    from service.graders import sandbox

    source = "def grade(sample, item):\n    return float(len(sample['output_text']))\n"
    samples = [{"output_text": "x" * i} for i in range(64)]
    out: dict[str, Any] = {}
    boxes = {
        "bwrap": dict(kind="bwrap"),
        "bwrap_user_namespace": dict(kind="bwrap", user_namespace=True),
        "process": dict(kind="process"),
    }
    for name, how in boxes.items():
        box = sandbox.current(how["kind"], 65534, user_namespace=how.get("user_namespace"))  # type: ignore[arg-type]

        def batch(n: int, box: sandbox.Sandbox = box) -> None:
            sandbox.run_python_grader(source, samples[:n], [{}] * n, sandbox=box)

        out[name] = {
            "batch_of_64_ms": _median_ms(lambda: batch(64), 15),
            "batch_of_1_ms": _median_ms(lambda: batch(1), 15),
        }
    return out


def dry_run() -> dict[str, Any]:
    from service.core.db import reset_caches
    from service.core.settings import Settings
    from service.infra import embedded_redis
    from service.jobs import dry_runs

    with tempfile.TemporaryDirectory() as home:
        settings = Settings(home=Path(home))
        redis_proc = embedded_redis.start(settings, daemonize=False)
        env = {**os.environ, "RLOO_HOME": home, "REDIS_URL": settings.redis_url, "RLOO_QUEUE": "bench"}
        os.environ.update({"RLOO_HOME": home, "REDIS_URL": settings.redis_url})
        reset_caches()
        worker = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "worker", "--queue", "bench-graders"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        grader = {
            "type": "string_check",
            "name": "s",
            "input": "{{ sample.output_text }}",
            "reference": "{{ item.answer }}",
            "operation": "eq",
        }
        payload = {"grader": grader, "model_sample": "red", "item": {"answer": "red"}}

        async def runs() -> list[float]:
            await dry_runs.run(project="p", payload=payload, queue="bench-graders", timeout=60, cap=4)  # warm
            times = []
            for _ in range(60):
                t0 = time.perf_counter()
                answer = await dry_runs.run(project="p", payload=payload, queue="bench-graders", timeout=60, cap=4)
                times.append(time.perf_counter() - t0)
                assert answer["reward"] == 1.0, answer
            return times

        try:
            times = sorted(asyncio.run(runs()))
        finally:
            worker.terminate()
            worker.wait(timeout=30)
            if redis_proc is not None:
                redis_proc.terminate()
                redis_proc.wait(timeout=10)
    return {
        "string_check_ms": {
            "p50": round(times[len(times) // 2] * 1000, 1),
            "p95": round(times[int(len(times) * 0.95)] * 1000, 1),
        }
    }


def json_door() -> dict[str, Any]:
    from service.core import strictjson

    job = (ROOT / "examples" / "demo" / "job.json").read_text()
    big = json.dumps({"grader": {"type": "string_check"}, "model_sample": "word " * 200_000, "item": {"a": 1.5}})
    out = {}
    for name, text in (("job_body_1kb", job), ("dry_run_body_1mb", big)):
        n = 2000 if len(text) < 10_000 else 20
        plain = _median_s(lambda t=text: json.loads(t), n)
        strict = _median_s(lambda t=text: strictjson.loads(t), n)
        out[name] = {"json_loads_us": round(plain * 1e6, 1), "strictjson_loads_us": round(strict * 1e6, 1)}
    return out


def checkpoint_download() -> dict[str, Any]:
    from service.api.tarstream import TarLayout

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "step-1"
        directory.mkdir()
        for i in range(4):
            (directory / f"model-{i}.safetensors").write_bytes(os.urandom(64 * 2**20))
        files = [(f"ckpt/{p.name}", p) for p in sorted(directory.iterdir())]

        t0 = time.perf_counter()
        layout = TarLayout(files)
        chunks = layout.read(0, layout.size)
        sent = len(next(chunks))
        first = time.perf_counter() - t0
        for chunk in chunks:
            sent += len(chunk)
        streamed = time.perf_counter() - t0
        assert sent == layout.size

        t0 = time.perf_counter()
        with tarfile.open(Path(tmp) / "copy.tar", "w") as tar:  # what the download did before
            for name, path in files:
                tar.add(path, arcname=name)
        copied = time.perf_counter() - t0
    return {
        "size_mib": 256,
        "streamed_first_byte_ms": round(first * 1000, 2),
        "streamed_whole_s": round(streamed, 3),
        "copy_first_then_serve_first_byte_s": round(copied, 3),
        "disk_written_mib": {"streamed": 0, "copy_first": 256},
    }


def main() -> None:
    print(
        json.dumps(
            {
                "python_grader": python_grader(),
                "dry_run": dry_run(),
                "json_door": json_door(),
                "checkpoint_download": checkpoint_download(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
