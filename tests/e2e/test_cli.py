"""The CLI as users run it: `rloo up` until Ctrl-C, and `rloo train` in the foreground."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.data import EXAMPLES, ROOT
from tests.helpers.live import child_env, free_port


def _demo_spec(tmp_path: Path) -> Path:
    """The demo's job spec with an absolute training_file, written under tmp_path."""
    spec = tmp_path / "job.json"
    body = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    body["training_file"] = str(EXAMPLES / "demo" / "train.jsonl")
    spec.write_text(json.dumps(body))
    return spec


@pytest.mark.e2e
def _child(parent: int, marker: bytes, *, wait: bool = True) -> int:
    """The pid of ``parent``'s child whose command line holds ``marker`` (0: none)."""
    deadline = time.monotonic() + (30 if wait else 0)
    while True:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == parent and marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
            except (OSError, ValueError, IndexError):
                continue
        if time.monotonic() >= deadline:
            return 0
        time.sleep(0.1)


def test_up_serves_and_ctrl_c_stops_every_child(tmp_path: Path, models_dir: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "up", "--port", str(port)],
        cwd=ROOT,
        env=child_env(tmp_path, models_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 90
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "RLOO_API_KEY=" in line:
                break
        out = "".join(lines)
        match = re.search(r"RLOO_BASE_URL=(\S+) RLOO_API_KEY=(\S+)", out)
        assert match, out
        base, key = match.groups()
        assert base == f"http://127.0.0.1:{port}/v1"
        r = httpx.get(base + "/files", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200 and r.json()["object"] == "list"
        # The stack said it was up once the inference worker had loaded the model that writes text
        # (not the reward model): the first chat pays for no load.
        assert re.search(r"preloaded tiny-policy in \d", out) and "preloaded tiny-reward" not in out, out
        chat = {"model": "tiny-policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(base + "/chat/completions", json=chat, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
        # The key is stored hashed: its text appears nowhere in the database file.
        assert key.encode() not in (tmp_path / "var" / "rloo.db").read_bytes()

        # A part that dies is started again; the rest of the stack never notices.
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
        graders = _child(proc.pid, b"--queue\x00rloo-graders")
        os.killpg(graders, signal.SIGKILL)
        assert httpx.get(base + "/files", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 200
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _child(proc.pid, b"--queue\x00rloo-graders", wait=False) in (0, graders):
            time.sleep(0.2)
        assert _child(proc.pid, b"--queue\x00rloo-graders", wait=False) not in (0, graders), "".join(lines)
        assert any("grader-worker exited with -9; starting it again" in line for line in lines), "".join(lines)
        assert _child(proc.pid, b"--serve")  # an inference worker is part of the stack
        # Celery's run-as-root banner (about pickle, which these workers refuse) is not printed.
        assert not any("superuser privileges" in line for line in lines), "".join(lines)
        assert proc.poll() is None

        children = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
        # Within the parts' grace and then the broker's (20 s each), with room for a loaded machine.
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            tree = subprocess.run(["ps", "-o", "pid,pgid,stat,etime,args", "-g", str(proc.pid)], capture_output=True)
            raise AssertionError(f"rloo up still running:\n{tree.stdout.decode()}\n{''.join(lines)}") from None
        assert code == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.5)
    alive = [
        pid
        for pid in children
        if Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    ]
    assert alive == [], alive
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    assert not (tmp_path / "var" / "redis.sock").exists()


def _train(tmp_path: Path, models_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``rloo train`` in a subprocess, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "train", *args],
        cwd=ROOT,
        env=child_env(tmp_path, models_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_train_runs_in_the_foreground(tmp_path: Path, models_dir: Path) -> None:
    spec = str(_demo_spec(tmp_path))
    sets = ["--set", "max_steps=3", "--set", "rloo_k=2", "--set", "checkpoint_interval=2"]
    out = _train(tmp_path, models_dir, spec, *sets, "--output-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    steps, summary = lines[:-1], lines[-1]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["total_steps"] == 3 and "train_reward_mean" in s for s in steps)
    assert summary["status"] == "succeeded" and summary["steps"] == 3
    assert Path(summary["final_checkpoint"], "config.json").is_file()

    # --resume continues a run from one of its checkpoints (here with one more step allowed); not from
    # step 2 while the run's directory holds step 3 (two futures would mix), but once step 3 is gone.
    sets[1] = "max_steps=4"
    mixed = _train(tmp_path, models_dir, spec, *sets, "--resume", str(tmp_path / "run" / "step-2"))
    failed = json.loads(mixed.stdout.splitlines()[-1])
    assert mixed.returncode == 1 and failed["error"]["code"] == "resume_failed"
    assert "past step 2" in failed["error"]["message"]
    shutil.rmtree(tmp_path / "run" / "step-3")
    again = _train(tmp_path, models_dir, spec, *sets, "--resume", str(tmp_path / "run" / "step-2"))
    assert again.returncode == 0, again.stderr
    lines = [json.loads(line) for line in again.stdout.splitlines()]
    assert [s["step"] for s in lines[:-1]] == [3, 4]
    assert lines[0]["train_reward_mean"] == steps[2]["train_reward_mean"]  # step 3 replays exactly
    assert lines[-1]["resumed_from"] == 2 and lines[-1]["final_checkpoint"] == str(tmp_path / "run" / "step-4")
    bad = _train(tmp_path, models_dir, spec, *sets, "--resume", str(tmp_path / "run"))
    assert bad.returncode == 2 and "not a checkpoint" in bad.stderr and "Traceback" not in bad.stderr


def test_train_rejects_a_bad_spec_with_a_clear_message(tmp_path: Path, models_dir: Path) -> None:
    out = _train(tmp_path, models_dir, str(_demo_spec(tmp_path)), "--set", "rloo_k=1")
    assert out.returncode == 2
    assert "rloo_k" in out.stderr and "Traceback" not in out.stderr
    # A misspelt name: the API's words, and the name meant.
    out = _train(tmp_path, models_dir, str(_demo_spec(tmp_path)), "--set", "rloo_K=4")
    assert out.returncode == 2
    assert "Unknown parameter 'method.reinforcement.hyperparameters.rloo_K'. Did you mean 'rloo_k'?" in out.stderr


@pytest.mark.e2e
def test_demo_runs_a_job_over_http_and_reports_it(tmp_path: Path, models_dir: Path) -> None:
    """``rloo demo`` as ``make demo`` runs it (two steps here): the example files found from any
    working directory, the job run over HTTP, and the report printed; the stack stopped after."""
    port = free_port()
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "demo", "--port", str(port), "--set", "max_steps=2"],
        cwd=tmp_path,
        env={**child_env(tmp_path, models_dir), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "uploaded train.jsonl" in out.stdout and "2 steps" in out.stdout
    assert re.search(r"steps:\s+2\b", out.stdout), out.stdout
    final = re.search(r"on disk:\s+(\S+)", out.stdout)
    assert final and (Path(final.group(1)) / "config.json").is_file(), out.stdout
    assert "what the reward looks like" in out.stdout and re.search(r"best at step 2 \(reward", out.stdout), out.stdout
    # What it trained, used: the fine-tuned model answers, and the evaluation table compares it with the start.
    assert re.search(r"'Name the color of the apple.' -> '", out.stdout), out.stdout
    assert re.search(r"expect no sense here: the demo's policy is a 0\.\d+M-parameter model", out.stdout), out.stdout
    assert re.search(r"starting model\s+│\s+\d\.\d{3}", out.stdout), out.stdout
    assert re.search(r"final checkpoint \(step 2\)\s+│\s+\d\.\d{3}", out.stdout), out.stdout
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
