"""``rloo jobs watch``: a job followed live from its event stream until it ends. On a terminal, a
view redrawn in place (step of total and a bar, ETA, the reward and KL with a sparkline of the
reward, the latest recorded step's best and worst completions, the latest events); elsewhere, a
line a step and a line an event. The exit code says how the job ended."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from worker.cli.http import Api
from worker.engine.samples import best_and_worst, is_sample_step

EXIT_CODES = {"succeeded": 0, "failed": 1, "cancelled": 2}
SPARKS = "▁▂▃▄▅▆▇█"
HEADLINES = ("train_reward_mean", "train_loss")
"""What a step is judged by: the reward (reinforcement), else the loss (supervised, DPO)."""


def sparkline(values: list[float], width: int = 60) -> str:
    """A one-line curve (each column a bucket of steps, the mean of its rewards)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return ""
    buckets = max(1, math.ceil(len(values) / width))
    means = [sum(chunk) / len(chunk) for i in range(0, len(finite), buckets) if (chunk := finite[i : i + buckets])]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int((m - lo) / span * (len(SPARKS) - 1) + 0.5))] for m in means)


def best_and_worst_line(groups: list[dict[str, Any]], step: int) -> list[str]:
    """The recorded step's best and worst completions, a line each."""
    return [
        f"  {label} at step {step} (reward {c['reward']:.3g}): {c['text'][:100]!r}"
        for label, c in best_and_worst(groups)
    ]


@dataclass
class View:
    job_id: str
    total: int
    status: str = "queued"
    step: int = 0
    started: float = field(default_factory=time.monotonic)
    first_step_at: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    curve: list[float] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)
    """The latest recorded step's best and worst completions."""

    def add(self, event: dict[str, Any]) -> str:
        """Take one event; returns the plain line that tells it."""
        if event.get("type") == "metrics" and event.get("data"):
            data = event["data"]
            self.step = int(data.get("step", self.step + 1))
            self.first_step_at = self.first_step_at or time.monotonic()
            self.status = "running"
            self.metrics = data
            headline = next((data[k] for k in HEADLINES if isinstance(data.get(k), (int, float))), None)
            if headline is not None:
                self.curve.append(float(headline))
            return self.step_line()
        self.events = [*self.events[-4:], event["message"]]
        return f"[{event['level']}] {event['message']}"

    def eta(self) -> str:
        if self.first_step_at is None or self.step < 2 or not self.total:
            return "?"
        per_step = (time.monotonic() - self.first_step_at) / (self.step - 1)
        return f"{max(0.0, per_step * (self.total - self.step)):.0f}s"

    def step_line(self) -> str:
        m = self.metrics
        parts = [f"step {self.step}/{self.total or '?'}"]
        for key, label in (("train_reward_mean", "reward"), ("train_loss", "loss"), ("kl", "kl")):
            if isinstance(m.get(key), (int, float)):
                parts.append(f"{label} {m[key]:.4g}")
        parts.append(f"eta {self.eta()}")
        return "  ".join(parts)

    def render(self) -> Any:
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        grid = Table.grid(padding=(0, 1))
        grid.add_row("job", f"{self.job_id}  [bold]{self.status}[/]")
        grid.add_row("step", ProgressBar(total=max(self.total, 1), completed=self.step, width=40))
        grid.add_row("", self.step_line())
        if self.curve:
            grid.add_row("curve", f"{sparkline(self.curve)}  {self.curve[0]:.3g} → {self.curve[-1]:.3g}")
        for line in self.samples:  # the texts are the model's and the user's: never rich markup
            grid.add_row("", Text(line.strip()))
        for message in self.events:
            grid.add_row("", Text(message, style="dim"))
        return Panel(grid, title="rloo jobs watch", expand=False)


def watch(api: Api, job_id: str) -> int:
    """Follow ``job_id`` until it ends; returns the exit code of its final status."""
    from rich.console import Console
    from rich.live import Live

    job = api.call("GET", f"/fine_tuning/jobs/{job_id}")
    view = View(job_id, int((job.get("progress") or {}).get("total_steps") or 0), status=job["status"])
    console = Console()
    interval = int((job.get("hyperparameters") or {}).get("sample_interval") or 0)
    stream = api.stream(f"/fine_tuning/jobs/{job_id}/events?stream=true")

    def take(event: dict[str, Any]) -> list[str]:
        lines = [view.add(event)]
        if event.get("type") == "metrics" and is_sample_step(view.step, view.total, interval):
            page = api.call(
                "GET",
                f"/fine_tuning/jobs/{job_id}/samples",
                params={"after_step": view.step - 1, "limit": 1},
                patient=True,  # the API may be restarting: the stream itself reconnects
            )
            if page["data"] and page["data"][0]["step"] == view.step:
                view.samples = best_and_worst_line(page["data"][0]["groups"], view.step)
                lines += view.samples
        return lines

    if console.is_terminal:
        with Live(view.render(), console=console, refresh_per_second=4) as live:
            for _, event in stream:
                take(event)
                live.update(view.render())
    else:
        for _, event in stream:
            print("\n".join(take(event)), flush=True)
    final = api.call("GET", f"/fine_tuning/jobs/{job_id}", patient=True)
    error = final.get("error") or {}
    print(f"{job_id} {final['status']}" + (f": {error.get('message')}" if error else ""), flush=True)
    return EXIT_CODES.get(final["status"], 3)
