"""The dashboard in a real headless Chromium (Debian's ``chromium``, driven by Playwright) against a
live stack: the key typed once, the jobs page, a job page whose reward curve draws the job's own
points and gains a new step without a reload, the cancel button, the files page and the grader
playground, and the fleet page to an operator's key; no JavaScript error in the console
throughout. Screenshots of the job page and the fleet page are saved (``RLOO_DASHBOARD_SCREENSHOT``,
or the test's temporary directory)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.browser import CHROMIUM, open_page
from tests.helpers.data import EXAMPLES, job_body
from tests.helpers.live import live_stack, upload_path
from tests.helpers.scoring import Endpoint

pytestmark = pytest.mark.e2e


def _slow_scores(n: int, body: dict[str, Any]) -> tuple[int, Any]:
    time.sleep(0.5)  # a step every half second or so: the page watches it train
    return 200, {"scores": [len(s["sample"]["output_text"]) % 3 / 2 for s in body["samples"]]}


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: .ci/system-packages installs it")
def test_the_dashboard_follows_a_job_live_in_a_real_browser(tmp_path: Path, models_dir: Path) -> None:
    from playwright.sync_api import sync_playwright

    scorer = Endpoint(_slow_scores)
    env = {"RLOO_HTTP_GRADER_URLS": json.dumps([f"http://127.0.0.1:{scorer.server.server_port}/"])}
    try:
        with live_stack("embedded", tmp_path, models_dir, env=env) as stack, sync_playwright() as pw:
            http = stack.http
            stack.start("graders", "worker", "--queue", stack.env.get("RLOO_QUEUE", "rloo") + "-graders")
            file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
            body = job_body(file_id, hp={"max_steps": 40, "rloo_k": 4, "sample_interval": 2})
            body["method"]["reinforcement"]["grader"] = {"type": "http", "name": "slow", "url": scorer.url}
            job_id = http.post("/fine_tuning/jobs", json=body).json()["id"]

            page, problems = open_page(pw)

            # GET / is the dashboard; it asks for the key once, and keeps it out of every URL.
            page.goto(stack.url + "/")
            assert page.url.endswith("/dashboard/")
            page.fill("#key", stack.key)
            page.click("#login button[type=submit]")
            page.wait_for_selector(f"#jobs a[href='#/jobs/{job_id}']")
            assert stack.key not in page.url
            assert page.evaluate("sessionStorage.getItem('rloo-key')") == stack.key

            # The job page: the reward curve draws the job's own points, and grows without a reload.
            page.click(f"#jobs a[href='#/jobs/{job_id}']")
            curve = "canvas[data-metric=train_reward_mean]"
            page.wait_for_function(f"(document.querySelector('{curve}')?.points || []).length >= 3", timeout=120_000)
            drawn = page.evaluate(f"document.querySelector('{curve}').points")
            rows = {
                m["step"]: m["train_reward_mean"]
                for m in http.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"]
            }
            assert [p[0] for p in drawn] == list(range(1, len(drawn) + 1))
            assert all(p[1] == pytest.approx(rows[p[0]]) for p in drawn)  # the job's points, not made up
            n = len(drawn)
            page.wait_for_function(f"document.querySelector('{curve}').points.length > {n}", timeout=60_000)
            blue = page.evaluate(
                f"""(() => {{ const c = document.querySelector('{curve}');
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;
                for (let i = 0; i < d.length; i += 4) if (d[i + 2] > 180 && d[i] < 120) n++; return n; }})()"""
            )
            assert blue > 50, blue  # a line was drawn, not only a frame
            page.wait_for_selector("#events div")
            page.wait_for_selector("#samples th >> text=/step \\d+: prompt/", timeout=60_000)  # what it rewarded
            page.screenshot(
                path=str(Path(os.environ.get("RLOO_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))), full_page=True
            )

            # The cancel button cancels the running job.
            page.click("#cancel")
            page.wait_for_selector("#status.status-cancelled", timeout=60_000)
            assert http.get(f"/fine_tuning/jobs/{job_id}").json()["status"] == "cancelled"

            # An evaluation started from the job page: the starting model and the checkpoints so far, scored
            # by the job's grader on an inference worker, shown as the API answers it.
            stack.start("serve", "worker", "--serve")
            page.select_option("#eval-file", file_id)
            page.click("#evaluate")
            page.wait_for_selector("#eval-status .status-succeeded", timeout=120_000)
            evaluation = http.get(f"/fine_tuning/jobs/{job_id}/evaluations").json()["data"][0]
            shown = page.eval_on_selector_all("#evaluations td.reward", "cells => cells.map(c => c.textContent)")
            assert shown == [f"{r['reward_mean']:.3f}" for r in evaluation["results"]], (shown, evaluation)
            assert evaluation["results"][0]["step_number"] is None and evaluation["samples"] == 20
            shot = Path(os.environ.get("RLOO_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
            page.screenshot(path=str(shot.with_name(shot.stem + "-evaluation.png")), full_page=True)

            # An eval's runs side by side (the job's starting model, and the lines' own answers), drawn as
            # bars of their pass rates; the job page shows its model's run.
            runs = _eval_with_two_runs(http)
            page.goto(stack.url + f"/dashboard/#/evals/{runs[0]['eval_id']}")
            for run in runs:
                row = f"#eval-runs tr[data-run='{run['id']}']"
                page.wait_for_selector(f"{row} .status-completed", timeout=30_000)
                shares = page.eval_on_selector_all(f"{row} td.pass", "cells => cells.map(c => Number(c.dataset.share))")
                counts = run["result_counts"]
                wanted = [counts["passed"] / counts["total"]] + [
                    r["passed"] / (r["passed"] + r["failed"]) for r in run["per_testing_criteria_results"]
                ]
                assert shares == pytest.approx(wanted, abs=1e-4), (shares, run)
            page.wait_for_selector("#output-items td.status-pass")
            page.screenshot(path=str(shot.with_name(shot.stem + "-eval.png")), full_page=True)
            page.goto(stack.url + f"/dashboard/#/jobs/{job_id}")
            page.wait_for_selector(f"#job-eval-table tr[data-run='{runs[0]['id']}']")
            assert page.locator(f"#job-eval-table tr[data-run='{runs[1]['id']}']").count() == 0  # not its model's

            # The files page and the grader playground.
            page.goto(stack.url + "/dashboard/#/files")
            page.wait_for_selector(f"#files td >> text={file_id}")
            page.goto(stack.url + "/dashboard/#/graders")
            page.click("#run")
            page.wait_for_selector("#result >> text=reward 1")
            page.context.browser.close()
            assert problems == [], problems
    finally:
        scorer.close()


def _eval_with_two_runs(http: httpx.Client) -> list[dict[str, Any]]:
    """An eval, a run of it answered by tiny-policy and one of the lines' own answers, both ended."""
    schema = {"type": "object", "properties": {"q": {"type": "string"}, "a": {"type": "string"}}}
    exact = {
        "type": "string_check",
        "name": "exact",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.a }}",
        "operation": "eq",
    }
    near = {
        "type": "text_similarity",
        "name": "near",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.a }}",
        "evaluation_metric": "fuzzy_match",
        "pass_threshold": 0.5,
    }
    body = {
        "name": "colours",
        "data_source_config": {"type": "custom", "item_schema": schema},
        "testing_criteria": [exact, near],
    }
    e = http.post("/evals", json=body).json()
    lines = [{"item": {"q": "Sky?", "a": "blue"}, "sample": {"output_text": a}} for a in ("blue", "blu", "red")]
    sources = [
        {
            "type": "completions",
            "model": "tiny-policy",
            "source": {"type": "file_content", "content": lines[:2]},
            "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{ item.q }}"}]},
            "sampling_params": {"max_completion_tokens": 4},
        },
        {"type": "jsonl", "source": {"type": "file_content", "content": lines}},
    ]
    runs = [http.post(f"/evals/{e['id']}/runs", json={"data_source": s}).json() for s in sources]
    deadline = time.monotonic() + 60
    while any(r["status"] != "completed" for r in runs):
        assert time.monotonic() < deadline, runs
        time.sleep(0.3)
        runs = [http.get(f"/evals/{e['id']}/runs/{r['id']}").json() for r in runs]
    assert runs[1]["result_counts"] == {"total": 3, "errored": 0, "failed": 2, "passed": 1}
    return runs


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: .ci/system-packages installs it")
def test_the_dashboard_shows_the_fleet_to_an_operator_key(tmp_path: Path, models_dir: Path) -> None:
    """The fleet page lists the training workers as GET /v1/workers answers them, to an operator's
    key; a project's key is shown the API's 403, which says how to get one."""
    from playwright.sync_api import sync_playwright

    with live_stack("embedded", tmp_path, models_dir) as stack, sync_playwright() as pw:
        operator = stack.cli("keys", "create", "--project", "ops", "--operator").stdout.strip().splitlines()[-1]
        page, problems = open_page(pw, height=800)

        page.goto(stack.url + "/dashboard/#/fleet")
        page.fill("#key", operator)
        page.click("#login button[type=submit]")
        page.wait_for_selector("#fleet tr.live td.devices")  # the stack's worker, once it has registered
        shown = page.eval_on_selector_all("#fleet tr.live", "rows => rows.map(r => r.cells[0].textContent)")
        listed = httpx.get(f"{stack.url}/v1/workers", headers={"Authorization": f"Bearer {operator}"}).json()["data"]
        assert shown == [w["id"] for w in listed] and len(shown) == 1, (shown, listed)
        assert page.text_content("#fleet tr.live td.devices") == f"{listed[0]['devices']} x {listed[0]['accelerator']}"
        shot = Path(os.environ.get("RLOO_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
        page.screenshot(path=str(shot.with_name(shot.stem + "-fleet.png")), full_page=True)
        assert problems == [], problems

        page.click("#signout")
        page.fill("#key", stack.key)  # the project's key
        page.click("#login button[type=submit]")
        page.wait_for_selector("main .error >> text=operator key")
        assert page.query_selector("#fleet") is None
        assert page.is_hidden("nav a[href='#/fleet']") and page.is_visible("nav a[href='#/files']")

        # A read-only key (jobs:read) sees its project's jobs, and no button or page it may not use.
        reader = stack.cli("keys", "create", "--project", "e2e", "--scope", "jobs:read", "--name", "viewer")
        job_id = _a_cancelled_job(stack.http)
        page.click("#signout")
        page.goto(stack.url + f"/dashboard/#/jobs/{job_id}")
        page.fill("#key", reader.stdout.strip().splitlines()[-1])
        page.click("#login button[type=submit]")
        page.wait_for_selector("#status.status-cancelled")
        assert page.text_content("#whoami") == "e2e · viewer"
        assert page.query_selector("#cancel") is None and page.query_selector("#evaluate") is None
        assert "may read evaluations, not start them" in page.text_content("#eval-note")
        hidden = {a: page.is_hidden(f"nav a[href='#/{a}']") for a in ("jobs", "evals", "files", "graders", "fleet")}
        assert hidden == {"jobs": False, "evals": False, "files": True, "graders": True, "fleet": True}, hidden

        # The usage page: a row a day, as GET /v1/usage answers it.
        page.click("nav a[href='#/usage']")
        page.wait_for_selector("#usage")
        usage = stack.http.get("/usage?group_by=day").json()
        shown = page.eval_on_selector_all(
            "#usage tr[data-day] td.hours", "cells => cells.map(c => Number(c.textContent))"
        )
        days = sorted({u["day"] for u in usage["data"]})
        wanted = [next((u["device_hours"] for u in usage["data"] if u["day"] == d and u["kind"] == "device_seconds"), 0)
                  for d in days]  # fmt: skip
        assert shown == pytest.approx(wanted, abs=1e-4) and str(usage["stored_bytes"]) in page.text_content("#stored")
        page.context.browser.close()
        # The one error the console saw: the API's 403 itself.
        assert problems == [
            "console error: Failed to load resource: the server responded with a status of 403 (Forbidden)"
        ]


def _a_cancelled_job(http: httpx.Client) -> str:
    file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
    job_id = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 2})).json()["id"]
    assert http.post(f"/fine_tuning/jobs/{job_id}/cancel").status_code == 200
    return job_id
