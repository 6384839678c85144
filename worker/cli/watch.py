"""``rloo jobs watch``: a job followed live from its event stream until it ends. On a terminal, a
view redrawn in place (step of total and a bar, ETA, the reward and KL with a sparkline of the
reward, the latest events); elsewhere, a line a step and a line an event. The exit code says how
the job ended."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from worker.cli.http import Api

EXIT_CODES = {"succeeded": 0, "failed": 1, "cancelled": 2}
SPARKS = "▁▂▃▄▅▆▇█"
HEADLINES = ("train_reward_mean", "train_loss")
"""What a step is judged by: the reward (reinforcement), else the loss (supervised, DPO)."""


def sparkline(values: list[float], width: int = 40) -> str:
    """``values`` (the last ``width``) as a line of block characters, low to high."""
    values = values[-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - low) / span * len(SPARKS)))] for v in values)


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

    def add(self, event: dict[str, Any]) -> str | None:
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

        grid = Table.grid(padding=(0, 1))
        grid.add_row("job", f"{self.job_id}  [bold]{self.status}[/]")
        grid.add_row("step", ProgressBar(total=max(self.total, 1), completed=self.step, width=40))
        grid.add_row("", self.step_line())
        if self.curve:
            grid.add_row("curve", f"{sparkline(self.curve)}  {self.curve[0]:.3g} → {self.curve[-1]:.3g}")
        for message in self.events:
            grid.add_row("", f"[dim]{message}[/]")
        return Panel(grid, title="rloo jobs watch", expand=False)


def watch(api: Api, job_id: str) -> int:
    """Follow ``job_id`` until it ends; returns the exit code of its final status."""
    from rich.console import Console
    from rich.live import Live

    job = api.call("GET", f"/fine_tuning/jobs/{job_id}")
    view = View(job_id, int((job.get("progress") or {}).get("total_steps") or 0), status=job["status"])
    console = Console()
    stream = api.stream(f"/fine_tuning/jobs/{job_id}/events?stream=true")
    if console.is_terminal:
        with Live(view.render(), console=console, refresh_per_second=4) as live:
            for _, event in stream:
                view.add(event)
                live.update(view.render())
    else:
        for _, event in stream:
            print(view.add(event), flush=True)
    final = api.call("GET", f"/fine_tuning/jobs/{job_id}", patient=True)
    error = final.get("error") or {}
    print(f"{job_id} {final['status']}" + (f": {error.get('message')}" if error else ""), flush=True)
    return EXIT_CODES.get(final["status"], 3)
