"""One job on two ranks, through the real API, a real Celery worker and PyTorch's elastic launcher
(``resources.gpus: 2`` on this CPU host: two gloo processes sharded with FSDP2).

* The same job on one rank and on two gives the same per-step metrics and the same final weights,
  within the tolerances below (the ranks' matrix products see other batch shapes, so sums round
  differently; AdamW's normalised steps carry those ulps into the weights); each test prints the
  largest difference it saw.
* A two-rank job paused, resumed, and one of its ranks killed mid-run still ends ``succeeded`` with
  every step recorded once, continuing from its checkpoints.
* The checkpoint two ranks wrote downloads as one Hugging Face directory that ``from_pretrained``
  loads.
"""

from __future__ import annotations

import io
import json
import os
import signal
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.data import EXAMPLES, FAKES
from tests.helpers.live import LiveStack, child_env, live_stack, run_cli, upload_path, wait_for
from worker.engine.metrics import TIMING_METRICS

pytestmark = pytest.mark.e2e

METRIC_RTOL, METRIC_ATOL = 1e-3, 1e-5
"""Per-step metrics of 2 ranks against 1. Rounding differences grow through AdamW (which scales a
tiny gradient up) and a second pass over the batch: seen 3e-4 relative at most (the grad norm at
step 4, two passes a step), against metrics that differ by tens of percent between seeds."""
WEIGHT_ATOL = 2e-3
"""Final weights after 4 steps of two passes at learning rate 0.01 (seen: 2.6e-4, of weights that moved 7e-2)."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[LiveStack]:
    """One stack for the module's jobs (each starts its own ranks)."""
    # Two ranks' collectives wait at most 60 s for a rank; a dead rank is noticed within a heartbeat.
    env = {"RLOO_COLLECTIVE_TIMEOUT_SECONDS": "60"}
    with live_stack("embedded", tmp_path_factory.mktemp("ranks"), models_dir, env=env, worker=False) as s:
        s.start("worker", "worker", "--gpus", "2")  # a CPU host offers one device unless told: two gloo ranks
        yield s


def _job(http: httpx.Client, file_id: str, *, gpus: int, validation: str | None = None, **hp: Any) -> str:
    body = {
        "model": "tiny-policy",
        "training_file": file_id,
        "validation_file": validation,
        "seed": 3,
        "resources": {"gpus": gpus},
        "method": {
            "type": "reinforcement",
            "reinforcement": {
                "grader": {
                    "type": "text_similarity",
                    "name": "answer",
                    "input": "{{ sample.output_text }}",
                    "reference": "{{ item.answer }}",
                    "evaluation_metric": "fuzzy_match",
                },
                "hyperparameters": {
                    "rloo_k": 4,
                    "batch_size": 4,
                    "learning_rate": 0.01,
                    "max_new_tokens": 6,
                    "kl_coef": 0.05,
                    "normalize_advantages": True,
                    "sample_interval": 2,
                    **hp,
                },
            },
        },
    }
    r = http.post("/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def _events(http: httpx.Client, job_id: str) -> list[str]:
    """Every event's message, page by page."""
    messages: list[str] = []
    params: dict[str, Any] = {"limit": 100}
    while True:
        page = http.get(f"/fine_tuning/jobs/{job_id}/events", params=params).json()
        messages += [e["message"] for e in page["data"]]
        if not page["has_more"]:
            return messages
        params["after"] = page["data"][-1]["id"]


def _metrics(http: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    return list(http.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"])


def _final_weights(http: httpx.Client, job_id: str, where: Path) -> Any:
    """The job's final checkpoint, downloaded and loaded with ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    final = http.get(f"/fine_tuning/jobs/{job_id}/checkpoints").json()["data"][0]
    r = http.get(f"/fine_tuning/jobs/{job_id}/checkpoints/{final['id']}/content")
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        names = tar.getnames()
        assert not any("training_state" in n for n in names), names  # the shards stay server-side
        tar.extractall(where, filter="data")
    return AutoModelForCausalLM.from_pretrained(where / final["id"])


def test_two_ranks_train_what_one_rank_does(stack: LiveStack, tmp_path: Path) -> None:
    http = stack.http
    file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
    valid = upload_path(http, EXAMPLES / "demo" / "valid.jsonl")
    # Two passes a step (the second one's ratios clip), and validation on 5 prompts: 3 and 2 a rank.
    hp = {"max_steps": 4, "ppo_epochs": 2, "eval_interval": 2, "eval_samples": 5}
    one = _job(http, file_id, gpus=1, validation=valid, **hp)
    two = _job(http, file_id, gpus=2, validation=valid, **hp)
    for job_id in (one, two):
        job = wait_for(http, job_id, {"succeeded", "failed", "cancelled"}, 240, stack)
        assert job["status"] == "succeeded", (job["error"], stack.log_tail())
    events = _events(http, two)
    assert any("2 ranks on cpu (FSDP2)" in m for m in events), events

    a, b = _metrics(http, one), _metrics(http, two)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    worst = (0.0, "")
    for ma, mb in zip(a, b, strict=True):
        assert ma.keys() == mb.keys()
        for name, va in ma.items():
            if name in TIMING_METRICS or not isinstance(va, int | float):
                continue
            vb = mb[name]
            assert vb == pytest.approx(va, rel=METRIC_RTOL, abs=METRIC_ATOL), (ma["step"], name, va, vb)
            worst = max(worst, (abs(va - vb) / max(abs(va), 1e-2), f"step {ma['step']} {name}"))
    # The rollouts themselves are the same: each prompt group drew from its own seed.
    assert [m["completion_length_mean"] for m in a] == [m["completion_length_mean"] for m in b]
    assert any(m["ratio_clip_frac"] > 0 for m in a) and sum("valid_reward_mean" in m for m in b) == 2

    wa = _final_weights(http, one, tmp_path / "one").state_dict()
    wb = _final_weights(http, two, tmp_path / "two").state_dict()
    assert wa.keys() == wb.keys()
    moved = max(float((wa[k] - w0).abs().max()) for k, w0 in _base_weights(stack).items())
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    print(f"\n2 ranks vs 1: largest relative metric difference {worst[0]:.2e} ({worst[1]})")
    print(f"weights: {diff:.2e} apart; they moved {moved:.2e}")
    assert diff <= WEIGHT_ATOL < moved  # the weights did move, much more than the ranks differ


def _base_weights(stack: LiveStack) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(Path(stack.env["RLOO_MODELS_DIR"]) / "tiny-policy").state_dict())


def _rank_pid(job_id: str, rank: int, timeout: float = 60) -> int:
    """The process of rank ``rank`` of the running job (its environment names it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"worker.jobs.rank" in cmdline and job_id.encode() in cmdline and f"RANK={rank}".encode() in environ:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} of {job_id}")


def test_a_two_rank_job_paused_resumed_and_a_rank_killed_succeeds_with_every_step_once(stack: LiveStack) -> None:
    http = stack.http
    file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
    job_id = _job(http, file_id, gpus=2, n_epochs=10, max_steps=10, checkpoint_interval=2)
    wait_for(http, job_id, {"running"}, 120, stack, min_step=2)
    assert http.post(f"/fine_tuning/jobs/{job_id}/pause").status_code == 200
    paused = wait_for(http, job_id, {"paused"}, 120, stack)
    deadline = time.monotonic() + 60
    while (r := http.post(f"/fine_tuning/jobs/{job_id}/resume")).status_code == 409:  # still saving
        assert time.monotonic() < deadline, (r.text, stack.log_tail())
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    wait_for(http, job_id, {"running"}, 120, stack, min_step=paused["progress"]["step"] + 3)
    os.kill(_rank_pid(job_id, 1), signal.SIGKILL)
    job = wait_for(http, job_id, {"succeeded", "failed", "cancelled"}, 300, stack)
    assert job["status"] == "succeeded", (job["error"], stack.log_tail())
    events = _events(http, job_id)
    assert any(m.startswith("A rank of the job died") for m in events), events
    assert sum("Resumed from the checkpoint" in m for m in events) == 2  # after the pause, after the kill
    steps = [m["step"] for m in _metrics(http, job_id)]
    assert steps == list(range(1, 11))  # every step once: a replayed step overwrote its row


def _spec(tmp_path: Path, name: str, gpus: int, **hp: Any) -> Path:
    """The demo job with a LoRA adapter and two micro-batches, on ``gpus`` ranks."""
    body = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    body["training_file"] = str(EXAMPLES / "demo" / "train.jsonl")
    body["validation_file"] = str(EXAMPLES / "demo" / "valid.jsonl")
    body["resources"] = {"gpus": gpus}
    body["method"]["reinforcement"]["hyperparameters"].update(
        lora={"r": 4}, gradient_accumulation_steps=2, max_steps=3, precision="fp32", eval_samples=5, **hp
    )
    spec = tmp_path / name
    spec.write_text(json.dumps(body))
    return spec


@pytest.mark.parametrize("backend", ["transformers", "vllm"])
def test_rloo_train_runs_a_lora_job_on_two_ranks_as_on_one(tmp_path: Path, models_dir: Path, backend: str) -> None:
    """Through ``rloo train``; on the vLLM backend (its stand-in, tests/fakes/vllm) one engine a
    rank, each loaded with the weights gathered from the sharded policy, asleep through updates."""
    env = child_env(tmp_path, models_dir, RLOO_ROLLOUT_BACKEND=backend)
    if backend == "vllm":
        env["PYTHONPATH"] = os.pathsep.join([str(FAKES), env.get("PYTHONPATH", "")])
    runs = {}
    for gpus in (1, 2):
        out = run_cli(
            "train",
            str(_spec(tmp_path, f"job{gpus}.json", gpus)),
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path / f"run{gpus}"),
            env=env,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        runs[gpus] = lines
    (*steps1, _), (*steps2, summary2) = runs[1], runs[2]
    assert summary2["status"] == "succeeded" and [s["step"] for s in steps2] == [1, 2, 3]  # rank 0 alone prints
    for a, b in zip(steps1, steps2, strict=True):
        for name in ("train_reward_mean", "kl", "loss", "grad_norm", "entropy", "advantage_std", "valid_reward_mean"):
            assert b[name] == pytest.approx(a[name], rel=METRIC_RTOL, abs=METRIC_ATOL), (a["step"], name)
    checkpoint = Path(summary2["final_checkpoint"])
    assert (checkpoint / "training_state.dcp").is_dir() and not (checkpoint / "model.safetensors").exists()
    from safetensors.torch import load_file

    adapters = [load_file(tmp_path / f"run{gpus}" / "step-3" / "adapter_model.safetensors") for gpus in (1, 2)]
    assert adapters[0].keys() == adapters[1].keys() and len(adapters[0]) > 0
    assert max(float((adapters[0][k] - adapters[1][k]).abs().max()) for k in adapters[0]) <= WEIGHT_ATOL


def test_a_checkpoint_of_two_ranks_resumes_on_two_only(tmp_path: Path, models_dir: Path) -> None:
    from tests.helpers.training import config
    from worker.engine.errors import JobError
    from worker.engine.resume import check_resumable

    cfg = config(tmp_path, models_dir, max_steps=4)
    info = {"format_version": 1, "model": cfg.model, "seed": cfg.seed, "step": 2, "total_steps": 4, "ranks": 2}
    info["hyperparameters"] = cfg.hyperparameters.model_dump()
    with pytest.raises(JobError) as exc:
        check_resumable(cfg, info, 4)  # this process is one rank
    assert exc.value.code == "resume_failed" and "written by 2 rank(s)" in exc.value.message
    check_resumable(cfg, {**info, "ranks": 1}, 4)  # the same checkpoint from one rank would do
