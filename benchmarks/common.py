"""What the engine benchmarks share: the two model configs, the prompts, the reward and one run of ours.

The issue's fixed settings: Llama-style models built offline (byte-level BPE, vocab 512), k = 4,
8 prompts a step, 32 new tokens, fp32 on the CPU, 40 steps, KL 0.05 in the reward, one optimisation
pass, and a count reward: the number of ``a`` characters in the completion.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service import graders
from worker.engine.recorders import QuietRecorder

ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA = ROOT / "examples" / "demo" / "train.jsonl"
CONFIGS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_layers": 2},
    "small": {"hidden_size": 256, "num_layers": 4},
}
K, PROMPTS, NEW_TOKENS, STEPS, LR, KL = 4, 8, 32, 40, 1e-3, 0.05
SETTINGS = (
    f"k={K}, {PROMPTS} prompts a step, {NEW_TOKENS} new tokens, lr {LR} constant, KL {KL} in the reward, "
    "fp32 CPU, one pass, no dropout, reward = number of 'a' characters"
)
# Our engine needs a grader spec; the reward itself is replaced by count_reward (see counting_reward).
PLACEHOLDER_GRADER = {
    "type": "string_check",
    "name": "count_a",
    "input": "{{ sample.output_text }}",
    "reference": "a",
    "operation": "like",
}


def spec_hyperparameters(steps: int = STEPS) -> dict[str, Any]:
    """The settings above as a job's hyperparameters (a spec for ``rloo train`` or the API)."""
    return {
        "rloo_k": K,
        "batch_size": PROMPTS,
        "max_new_tokens": NEW_TOKENS,
        "learning_rate": LR,
        "kl_coef": KL,
        "max_steps": steps,
        "n_epochs": 1000,
    }


def count_reward(texts: list[str]) -> list[float]:
    """The benchmark's reward, one Python function for both trainers."""
    return [float(t.count("a")) for t in texts]


@contextlib.contextmanager
def counting_reward() -> Iterator[None]:
    """Score our engine's completions with ``count_reward``: the grader family has no counting
    grader, and a python grader would run in a sandboxed process TRL's reward function does not pay for."""
    import worker.engine.methods.rloo as train_mod

    real = train_mod.score_batch

    def score(
        grader: Any, *, prompts: list[str], texts: list[str], items: Any, reward_models: Any, sampled: Any = None
    ) -> Any:
        rewards = count_reward(texts)
        return graders.GradeResult(rewards=rewards, sub_rewards={"count_a": rewards}, errors={})

    train_mod.score_batch = score  # type: ignore[assignment]
    try:
        yield
    finally:
        train_mod.score_batch = real  # type: ignore[assignment]


def job_row(session: Any, project: str, model: str, **fields: Any) -> Any:
    """A job row of ``project`` (made if new), flushed: a supervised job running unless ``fields``
    say otherwise (what a benchmark needs without training one)."""
    from service.core.tables import Job
    from service.tenancy import projects

    proj = projects.get_or_create_project(session=session, name=project)
    values: dict[str, Any] = {
        "model": model,
        "base_model": model,
        "training_file": "file-x",
        "seed": 0,
        "method": {"type": "supervised"},
        "hyperparameters": {},
        "status": "running",
        "total_steps": 1,
        **fields,
    }
    job = Job(project_seq=proj.seq, **values)
    session.add(job)
    session.flush()
    return job


def build(models: Path, config: str) -> None:
    from worker.tiny.models import build_tiny_causal_lm

    build_tiny_causal_lm(models / config, seed=0, **CONFIGS[config])


def plain_prompts(tmp: Path) -> Path:
    """The demo prompts as plain text (``prompt``), so both trainers see the same strings."""
    from worker.engine.data import load_items

    out = tmp / "prompts.jsonl"
    with open(out, "w") as f:
        for item in load_items(DEMO_DATA):
            f.write(json.dumps({"prompt": f"Q: {item['messages'][-1]['content']}\nA:"}) + "\n")
    return out


class Collect(QuietRecorder):
    """A recorder that keeps each step's metrics and when the loop handed them over."""

    def __init__(self, *, quiet: bool = False) -> None:
        self.steps: list[dict[str, Any]] = []
        self.handed_at: list[float] = []
        self.quiet = quiet

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self.handed_at.append(time.perf_counter())
        self.steps.append(metrics)
        if not self.quiet:
            print(f"step {step}: reward {metrics['train_reward_mean']:.3f}", file=__import__("sys").stderr, flush=True)


def ours(
    models: Path,
    config: str,
    data: Path,
    out: Path,
    *,
    steps: int = STEPS,
    seed: int = 0,
    grader: dict[str, Any] | None = None,
    **hp: Any,
) -> dict[str, Any]:
    """One run of our engine (the same ``train`` a job runs); wall time and each step's metrics.
    The reward is ``count_reward`` unless ``grader`` names the job's own (a reward model, say)."""
    from service.jobs.hyperparameters import ReinforcementHyperparameters
    from worker.engine.config import TrainConfig
    from worker.engine.methods.rloo import train

    hyper = ReinforcementHyperparameters(
        rloo_k=K,
        batch_size=PROMPTS,
        max_new_tokens=NEW_TOKENS,
        learning_rate=LR,
        kl_coef=KL,
        max_steps=steps,
        n_epochs=1000,
        **hp,
    ).resolved()
    cfg = TrainConfig(
        model=config,
        training_file=data,
        grader=graders.parse_grader(grader or PLACEHOLDER_GRADER),
        hyperparameters=hyper,
        output_dir=out,
        models_dir=models,
        seed=seed,
        device="cpu",
    )
    rec = Collect(quiet=True)
    with counting_reward() if grader is None else contextlib.nullcontext():
        t0 = time.perf_counter()
        train(cfg, rec)  # type: ignore[arg-type]
        wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "steps": rec.steps,
        "handed_at": rec.handed_at,
        "rewards": [m["train_reward_mean"] for m in rec.steps],
    }


def trl_config(
    out: Path, *, seed: int, steps: int, learning_rate: float, k: int, prompts: int, new_tokens: int, beta: float
) -> Any:
    """TRL's ``RLOOConfig`` matched to a run of ours: fp32 on the CPU, a constant rate without warmup
    or decay, clipping at 1, ``prompts`` prompts of ``k`` samples a step (one generation batch per
    optimisation step, one pass), plain sampling at temperature 1, the KL ``beta`` in the reward,
    no dropout, a log line a step, nothing saved."""
    from trl import RLOOConfig

    return RLOOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=seed,
        max_steps=steps,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=k * prompts,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=k,
        max_completion_length=new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=beta,
        num_iterations=1,
        gradient_checkpointing=False,
        disable_dropout=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )


def first_last(rewards: list[float], n: int = 5) -> tuple[float, float]:
    return round(sum(rewards[:n]) / n, 3), round(sum(rewards[-n:]) / n, 3)


@contextlib.contextmanager
def local_stack(
    home: Path,
    models: Path,
    parts: list[list[str]],
    *,
    env: dict[str, str] | None = None,
    key_flags: tuple[str, ...] = (),
) -> Iterator[tuple[str, str]]:
    """The service as processes on the embedded defaults under ``home`` (the API, then ``parts``:
    each a ``rloo`` command line, e.g. ``["worker", "--serve"]``), no rate limit, a key of project
    ``bench`` (``key_flags``: e.g. ``--tinker``); yields the API's URL once ``/readyz`` answers, and
    its key. Stopped as ``rloo up`` stops its children (each process group), the embedded Redis after.
    Their output goes to ``home/stack.log``."""
    import os
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    values = {**os.environ, "RLOO_HOME": str(home / "var"), "RLOO_MODELS_DIR": str(models)}
    values.update(RLOO_RATE_LIMIT="0", RLOO_RATE_LIMIT_TINKER="0")
    values.update(env or {})
    values.pop("DATABASE_URL", None)
    values.pop("REDIS_URL", None)

    def cli(*args: str) -> str:
        run = [sys.executable, "-m", "worker.cli", *args]
        return subprocess.run(run, env=values, cwd=root, capture_output=True, text=True, check=True).stdout

    cli("db", "upgrade")
    key = cli("keys", "create", "--project", "bench", *key_flags).strip().splitlines()[-1]
    port = free_port()
    logs = open(home / "stack.log", "ab")  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "worker.cli", *args],
            env=values,
            cwd=root,
            stdout=logs,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for args in (["api", "--port", str(port)], *parts)
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _ready(url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack did not start: {(home / 'stack.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url, key
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=60)
        from service.core.settings import Settings
        from service.infra import embedded_redis

        embedded_redis.stop_daemon(Settings(home=home / "var"))


def _ready(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    """A loopback port free now (for a benchmark's own servers)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
