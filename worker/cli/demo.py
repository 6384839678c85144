"""``rloo demo``: the whole product in one command, on the embedded defaults.

Builds a tiny policy and reward model offline (if absent), starts the local stack, uploads the
example prompts over HTTP, creates an RLOO job, follows it with a live progress bar, and prints the
reward curve, the first-vs-last reward and where the final checkpoint is; then uses what it trained:
a chat completion from the fine-tuned model, and the starting model against the final checkpoint on
the held-out prompts (an evaluation on the inference worker).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from service.core.settings import get_settings
from worker.cli.watch import best_and_worst_line, sparkline
from worker.engine.checkpoints import checkpoint_dir, job_checkpoints_dir

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "demo"


def build_models(models_dir: Path, console: Console) -> None:
    from worker.tiny.models import build_tiny_causal_lm, build_tiny_reward_model, layout

    policy, reward = layout(models_dir)
    if not (policy / "config.json").is_file():
        with console.status("building a tiny policy offline (Llama-style, byte-level BPE trained on the spot)"):
            build_tiny_causal_lm(policy, seed=0)
    if not (reward / "config.json").is_file():
        with console.status("building a tiny reward model offline"):
            build_tiny_reward_model(reward, tokenizer_from=policy, seed=1)
    console.print(f"models: [bold]{policy}[/], [bold]{reward}[/]")


def follow(http: httpx.Client, job: dict[str, Any], console: Console) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    job_id = job["id"]
    series: list[dict[str, Any]] = []
    columns = (
        TextColumn("[bold]{task.description:>9}"),
        BarColumn(bar_width=30),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, refresh_per_second=4) as progress:
        task = progress.add_task("queued", total=job["progress"]["total_steps"], info="")
        while True:
            job = http.get(f"/fine_tuning/jobs/{job_id}").json()
            after = series[-1]["step"] if series else 0
            series += http.get(f"/fine_tuning/jobs/{job_id}/metrics", params={"after_step": after}).json()["data"]
            info = ""
            if series:
                last = series[-1]
                recent = [m["train_reward_mean"] for m in series[-5:] if m["train_reward_mean"] is not None]
                info = (
                    f"reward {last['train_reward_mean']:.3f} (mean of last 5: "
                    f"{sum(recent) / max(1, len(recent)):.3f})  kl {last['kl']:.2f}"
                )
            progress.update(task, description=job["status"], completed=job["progress"]["step"], info=info)
            if job["status"] in ("succeeded", "failed", "cancelled"):
                return job, series
            time.sleep(0.5)


def run_demo(port: int = 8000, overrides: dict[str, Any] | None = None) -> int:
    """The demo job (examples/demo/job.json, ``overrides`` over its hyperparameters) over HTTP."""
    from worker.cli.stack import Stack

    console = Console(width=None if sys.stdout.isatty() else 110)
    settings = get_settings()
    console.rule("[bold]rloo-service demo")
    console.print(f"home: {settings.home_dir}  (SQLite + embedded Redis; nothing to install or start)")
    build_models(settings.models_dir, console)

    stack = Stack("127.0.0.1", port, quiet=True)
    try:
        with console.status("starting the stack: migrations, embedded Redis, API, workers; the models loaded for chat"):
            key = stack.start()
        console.print(f"API at [bold]{stack.url}[/] (docs at {stack.url}/docs), logs in {settings.home_dir / 'logs'}")
        http = httpx.Client(base_url=stack.url + "/v1", headers={"Authorization": f"Bearer {key}"}, timeout=30)

        train = EXAMPLE_DIR / "train.jsonl"
        r = http.post("/files", files={"file": (train.name, train.read_bytes())}, data={"purpose": "fine-tune"})
        r.raise_for_status()
        file = r.json()
        console.print(f"uploaded {train.name}: {file['id']} ({file['line_count']} prompts)")

        body = json.loads((EXAMPLE_DIR / "job.json").read_text())
        body["training_file"] = file["id"]
        body["method"][body["method"]["type"]]["hyperparameters"].update(overrides or {})
        r = http.post("/fine_tuning/jobs", json=body)
        if r.status_code != 200:
            console.print(f"[red]job creation failed: {r.json()['error']['message']}")
            return 1
        job = r.json()
        hp, grader = job["hyperparameters"], body["method"][body["method"]["type"]]["grader"]
        console.print(
            f"job {job['id']}: RLOO, k={hp['rloo_k']}, {hp['batch_size']} prompts a step, "
            f"{job['progress']['total_steps']} steps, grader '{grader['name']}'"
        )

        job, series = follow(http, job, console)
        code = report(http, job, series, console)
        if code == 0:
            use_it(http, job, console)
        return code
    finally:
        with console.status("stopping the stack"):
            stack.stop()


def report(http: httpx.Client, job: dict[str, Any], series: list[dict[str, Any]], console: Console) -> int:
    if job["status"] != "succeeded":
        console.print(f"[red]job {job['status']}: {job['error']}")
        return 1
    rewards = [m["train_reward_mean"] for m in series]
    n = max(1, min(5, len(rewards) // 4))
    first, last = sum(rewards[:n]) / n, sum(rewards[-n:]) / n
    ckpt = http.get(f"/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"][0]
    settings = get_settings()
    path = checkpoint_dir(job_checkpoints_dir(settings.artifacts_dir, job["id"]), ckpt["step_number"])

    console.print()
    console.print(f"[bold]reward per step[/]  {sparkline(rewards)}")
    console.print(f"  steps:                  {len(series)}")
    console.print(f"  reward, first {n} steps:  {first:.3f}")
    console.print(f"  reward, last {n} steps:   {last:.3f}  ({last - first:+.3f})")
    console.print(f"  final checkpoint:       {ckpt['id']} (step {ckpt['step_number']})", soft_wrap=True)
    console.print(f"  on disk:                {path}", soft_wrap=True)
    console.print(
        f"  download:               GET /v1/fine_tuning/jobs/{job['id']}/checkpoints/{ckpt['id']}/content",
        soft_wrap=True,
    )
    console.print(f"  load it:                AutoModelForCausalLM.from_pretrained('{path}')", soft_wrap=True)
    samples = http.get(f"/fine_tuning/jobs/{job['id']}/samples", params={"after_step": len(series) - 1}).json()["data"]
    if samples:
        console.print()
        console.print(
            f"[bold]what the reward looks like[/] (GET /v1/fine_tuning/jobs/{job['id']}/samples)", soft_wrap=True
        )
        for line in best_and_worst_line(samples[-1]["groups"], samples[-1]["step"]):
            console.print(line, soft_wrap=True, markup=False)
    return 0


def parameters(model: str) -> str:
    """A model's size for people (``0.2M-parameter``), from its weight files' headers."""
    from service.registry.memory_plan import UnknownShape, model_shape

    try:
        return f"{model_shape(get_settings().models_dir / model).parameters / 1e6:.1f}M-parameter"
    except UnknownShape:
        return "tiny"


def use_it(http: httpx.Client, job: dict[str, Any], console: Console) -> None:
    """The fine-tuned model answers a held-out prompt through /v1/chat/completions, and an evaluation
    scores the starting model against the final checkpoint on the held-out prompts."""
    from rich.table import Table

    valid = EXAMPLE_DIR / "valid.jsonl"
    lines = [json.loads(line) for line in valid.read_text().splitlines() if line.strip()]
    console.print()
    console.print(f"[bold]use it[/]: POST /v1/chat/completions with model={job['fine_tuned_model']}", soft_wrap=True)
    question = lines[0]["messages"]
    r = http.post(
        "/chat/completions",
        json={"model": job["fine_tuned_model"], "messages": question, "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    if r.status_code != 200:
        console.print(f"[red]chat completion failed: {r.json()['error']['message']}")
        return
    answer = r.json()["choices"][0]["message"]["content"]
    console.print(f"  {question[-1]['content']!r} -> {answer!r}", soft_wrap=True, markup=False)
    console.print(
        f"  (expect no sense here: the demo's policy is a {parameters(job['model'])} model built on the spot and "
        "trained for a few steps on a fuzzy-match reward, which it raises without learning the language; "
        "examples/addition trains one that learns its task: README, Examples)",
        soft_wrap=True,
        style="dim",
    )

    r = http.post("/files", files={"file": (valid.name, valid.read_bytes())}, data={"purpose": "fine-tune"})
    r.raise_for_status()
    final = http.get(f"/fine_tuning/jobs/{job['id']}/checkpoints", params={"limit": 1}).json()["data"][0]
    body = {"file": r.json()["id"], "checkpoints": [final["id"]], "samples": len(lines), "seed": 0}
    evaluation = http.post(f"/fine_tuning/jobs/{job['id']}/evaluations", json=body).json()
    with console.status(f"evaluating the starting model and the final checkpoint on {valid.name}"):
        while evaluation["status"] in ("queued", "running"):
            time.sleep(0.5)
            evaluation = http.get(f"/fine_tuning/jobs/{job['id']}/evaluations/{evaluation['id']}").json()
    if evaluation["status"] != "succeeded":
        console.print(f"[red]evaluation {evaluation['status']}: {evaluation['error']}")
        return
    table = Table(title=f"held-out prompts ({len(lines)}), one sample each: {evaluation['id']}")
    for column in ("model", "reward", "± s.e.", "tokens"):
        table.add_column(column)

    def number(value: float | None, places: int = 3) -> str:
        return "n/a" if value is None else f"{value:.{places}f}"

    for row in evaluation["results"]:
        name = "starting model" if row["step_number"] is None else f"final checkpoint (step {row['step_number']})"
        table.add_row(
            name, number(row["reward_mean"]), number(row["reward_std_error"]), number(row["completion_length_mean"], 1)
        )
    console.print(table)
