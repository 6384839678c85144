"""Each method's job page in a real headless Chromium (as ``test_dashboard.py``), on one live stack
with three short jobs: a supervised job with a validation file, a DPO job without one, a one-pass
reinforcement job without one. Each page draws its own method's metrics, the job's own points, with
axis titles and a step's values on hover; a chart that can have no data says why; the one-pass
loss says it is about 0 by construction; the evaluation picker offers only the files an evaluation
can read (prompt lines), and a job without a grader says how to evaluate it instead. No JavaScript
error in the console. A screenshot of each page is saved (``RLOO_DASHBOARD_SCREENSHOT``'s directory,
or the test's temporary directory: ``dashboard-<method>.png``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.browser import CHROMIUM, open_page
from tests.helpers.data import EXAMPLES, job_body
from tests.helpers.live import live_stack, upload_path, wait_for

pytestmark = pytest.mark.e2e

CHARTS = {
    "supervised": ["train_loss", "train_mean_token_accuracy", "valid_loss", "valid_mean_token_accuracy"],
    "dpo": [
        "train_loss",
        "reward_margin",
        "reward_accuracy",
        "valid_loss",
        "valid_reward_margin",
        "valid_reward_accuracy",
    ],
    "reinforcement": ["train_reward_mean", "kl", "loss", "entropy", "completion_length_mean", "valid_reward_mean"],
}
"""The charts each method's page draws, in order (app.js's CHARTS)."""


def _jobs(http: httpx.Client) -> tuple[dict[str, str], dict[str, str]]:
    """The three jobs (by method) and the files they read (by what they hold)."""
    files = {
        "prompts": upload_path(http, EXAMPLES / "demo" / "train.jsonl"),
        "chat": upload_path(http, EXAMPLES / "supervised" / "train.jsonl"),
        "chat-valid": upload_path(http, EXAMPLES / "supervised" / "valid.jsonl"),
        "pairs": upload_path(http, EXAMPLES / "dpo" / "train.jsonl"),
    }
    small = {"max_steps": 4, "batch_size": 4}
    supervised = json.loads((EXAMPLES / "supervised" / "job.json").read_text())
    supervised.update(training_file=files["chat"], validation_file=files["chat-valid"])
    supervised["method"]["supervised"]["hyperparameters"].update(small, eval_interval=2, eval_samples=4)
    dpo = json.loads((EXAMPLES / "dpo" / "job.json").read_text())
    dpo.update(training_file=files["pairs"])
    del dpo["validation_file"]
    dpo["method"]["dpo"]["hyperparameters"].update(small)
    reinforcement = job_body(files["prompts"], hp={"max_steps": 3, "batch_size": 2, "rloo_k": 2})
    jobs = {}
    for method, body in (("supervised", supervised), ("dpo", dpo), ("reinforcement", reinforcement)):
        r = http.post("/fine_tuning/jobs", json=body)
        assert r.status_code == 200, r.text
        jobs[method] = r.json()["id"]
    return jobs, files


def _charts(page: Any) -> list[dict[str, Any]]:
    """Each chart of the page as drawn: its metric, title, points, empty text and note."""
    return page.eval_on_selector_all(
        ".chart",
        """charts => charts.map(c => { const canvas = c.querySelector('canvas');
        return { metric: canvas.dataset.metric, title: c.querySelector('h3').textContent,
                 points: canvas.points, count: Number(canvas.dataset.points), empty: canvas.dataset.empty,
                 note: c.querySelector('.note').textContent }; })""",
    )


def _check_points(charts: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every chart draws exactly the job's own rows of its metric, and says nothing is missing when
    it has them; the charts by metric."""
    by_metric = {}
    for chart in charts:
        expected = [[r["step"], r[chart["metric"]]] for r in rows if chart["metric"] in r]
        assert chart["title"] == chart["metric"]
        assert chart["count"] == len(chart["points"]) == len(expected), chart
        assert all(p[0] == e[0] and p[1] == pytest.approx(e[1]) for p, e in zip(chart["points"], expected, strict=True))
        assert (chart["empty"] == "") == bool(expected), chart  # "no data" only where there is none
        by_metric[chart["metric"]] = chart
    return by_metric


def _hover(page: Any, metric: str, rows: list[dict[str, Any]]) -> None:
    """Hovering the chart's right edge shows the last step's values in the tip."""
    canvas = page.locator(f"canvas[data-metric={metric}]")
    box = canvas.bounding_box()
    page.mouse.move(box["x"] + box["width"] - 14, box["y"] + box["height"] / 2)
    tip = page.locator(f".chart:has(canvas[data-metric={metric}]) .plot-tip")
    tip.wait_for(state="visible")
    last = [r for r in rows if metric in r][-1]
    text = tip.text_content()
    assert text.startswith(f"step {last['step']} · {metric} "), text
    assert float(text.rsplit(" ", 1)[1]) == pytest.approx(last[metric], rel=1e-3, abs=1e-6), (text, last)
    page.mouse.move(0, 0)
    tip.wait_for(state="hidden")


def _open(page: Any, url: str, job_id: str, method: str, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The job's page, once its metrics stream has brought every row; its charts by metric, checked
    against the job's rows."""
    page.goto(f"{url}/dashboard/#/jobs/{job_id}")
    page.wait_for_selector(f"h1 >> text={job_id}")
    expected = {m: sum(m in r for r in rows) for m in CHARTS[method]}
    page.wait_for_function(
        """expected => Object.entries(expected).every(([m, n]) =>
            Number(document.querySelector(`canvas[data-metric=${m}]`).dataset.points) === n)""",
        arg=expected,
    )
    assert page.text_content("#method") == method and page.text_content("#status") == "succeeded"
    charts = _charts(page)
    assert [c["metric"] for c in charts] == CHARTS[method], charts
    return _check_points(charts, rows)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: .ci/system-packages installs it")
def test_each_method_s_page_draws_its_own_metrics(tmp_path: Path, models_dir: Path) -> None:
    from playwright.sync_api import sync_playwright

    shot = Path(os.environ.get("RLOO_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
    with live_stack("embedded", tmp_path, models_dir) as stack, sync_playwright() as pw:
        http = stack.http
        jobs, files = _jobs(http)
        for job_id in jobs.values():
            assert wait_for(http, job_id, {"succeeded", "failed", "cancelled"}, 300, stack)["status"] == "succeeded"
        rows = {m: http.get(f"/fine_tuning/jobs/{j}/metrics").json()["data"] for m, j in jobs.items()}
        listed = {f["id"]: f["line_formats"] for f in http.get("/files").json()["data"]}
        assert listed[files["prompts"]] == {"prompt": 48} and listed[files["pairs"]] == {"preference": 48}

        page, problems = open_page(pw)
        page.goto(stack.url + "/dashboard/")
        assert "var/api_key" in page.text_content("#login")  # where the key rloo up printed is kept
        page.fill("#key", stack.key)
        page.click("#login button[type=submit]")
        page.wait_for_selector(f"#jobs a[href='#/jobs/{jobs['dpo']}']")

        # Supervised, with a validation file: train and valid loss and token accuracy, all drawn.
        charts = _open(page, stack.url, jobs["supervised"], "supervised", rows["supervised"])
        assert charts["train_loss"]["count"] == 4 and charts["valid_loss"]["count"] == 2  # steps 2 and 4
        assert all(c["note"] == "" for c in charts.values())
        _hover(page, "train_loss", rows["supervised"])
        _hover(page, "valid_mean_token_accuracy", rows["supervised"])
        assert page.query_selector("#eval-file") is None and "grader" in page.text_content("#eval-note")
        assert page.query_selector("#samples") is None  # only reinforcement records samples
        page.screenshot(path=str(shot.with_name(shot.stem + "-supervised.png")), full_page=True)

        # DPO, without a validation file: its loss, margin and accuracy drawn; the valid charts say why
        # they are empty.
        charts = _open(page, stack.url, jobs["dpo"], "dpo", rows["dpo"])
        for metric in ("train_loss", "reward_margin", "reward_accuracy"):
            assert charts[metric]["count"] == 4, charts[metric]
        for metric in ("valid_loss", "valid_reward_margin", "valid_reward_accuracy"):
            assert charts[metric]["empty"].startswith("no validation file"), charts[metric]
            assert "validation_file" in charts[metric]["note"], charts[metric]
        _hover(page, "reward_margin", rows["dpo"])
        page.screenshot(path=str(shot.with_name(shot.stem + "-dpo.png")), full_page=True)

        # Reinforcement, one pass a batch: the loss says it is about 0 by construction; the valid reward
        # says why it is empty; the evaluation picker offers the file of prompts only.
        charts = _open(page, stack.url, jobs["reinforcement"], "reinforcement", rows["reinforcement"])
        assert charts["train_reward_mean"]["count"] == 3
        assert "ppo_epochs is 1" in charts["loss"]["note"] and "by construction" in charts["loss"]["note"]
        assert all(abs(r["loss"]) < 1e-5 for r in rows["reinforcement"])  # what the note explains
        assert charts["valid_reward_mean"]["empty"].startswith("no validation file")
        assert all(charts[m]["note"] == "" for m in ("train_reward_mean", "kl", "entropy"))
        _hover(page, "train_reward_mean", rows["reinforcement"])
        page.wait_for_selector("#eval-file option", state="attached")
        offered = page.eval_on_selector_all("#eval-file option", "options => options.map(o => o.value)")
        assert offered == [files["prompts"]], (offered, files)
        assert page.is_enabled("#evaluate")
        page.wait_for_selector("#samples th >> text=/step \\d+: prompt/")
        page.screenshot(path=str(shot.with_name(shot.stem + "-reinforcement.png")), full_page=True)
        page.context.browser.close()
        assert problems == [], problems
