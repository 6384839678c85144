"""Scoring beside the reference forward (``worker.engine.overlap``): which graders score on a thread, and
that the thread really runs beside its caller, whose results and errors it hands back."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from service.graders import parse_grader
from worker.engine.overlap import Started
from worker.engine.rewards.scoring import scored_elsewhere

HTTP = {"type": "http", "name": "far", "url": "http://127.0.0.1:1/"}
PYTHON = {"type": "python", "name": "py", "source": "def grade(sample, item):\n    return 1.0\n"}
LOCAL_RM = {"type": "reward_model", "name": "rm", "model": "tiny-reward"}
REMOTE_RM = {**LOCAL_RM, "remote": True}
RULE = {"type": "string_check", "name": "s", "input": "{{ sample.output_text }}", "reference": "a", "operation": "eq"}


@pytest.fixture(autouse=True)
def _http_allowed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_HTTP_GRADER_URLS", '["http://127.0.0.1:1/"]')
    reset_caches()
    yield
    reset_caches()


def multi(*graders: dict[str, object]) -> dict[str, object]:
    subs = {f"g{i}": {**g, "name": f"g{i}"} for i, g in enumerate(graders)}
    return {"type": "multi", "name": "m", "graders": subs, "calculate_output": " + ".join(subs)}


@pytest.mark.parametrize(
    ("spec", "beside"),
    [
        (HTTP, True),
        (PYTHON, True),
        (REMOTE_RM, True),
        (multi(RULE, HTTP), True),  # the rule is cheap; the wait is the endpoint's
        (multi(REMOTE_RM, RULE), True),
        (RULE, False),  # nothing to wait on: a thread would only contend for the GIL
        (LOCAL_RM, False),  # it runs on this process's device, as the reference does
        (multi(HTTP, LOCAL_RM), False),
    ],
)
def test_graders_that_wait_on_other_processes_score_beside_the_step(spec: dict[str, object], beside: bool) -> None:
    assert scored_elsewhere(parse_grader(spec, allow_python=True)) is beside


def test_work_started_beside_runs_while_its_caller_goes_on() -> None:
    """The work waits for what its caller does after starting it: only a thread can finish it."""
    caller_went_on = threading.Event()

    def work() -> str:
        assert caller_went_on.wait(timeout=10), "the work ran before its caller went on"
        return "scores"

    started = Started(work, beside=True)
    caller_went_on.set()
    value, seconds = started.result()
    assert value == "scores" and seconds >= 0


def test_work_not_beside_runs_at_once_and_errors_reach_the_caller() -> None:
    ran: list[str] = []
    started = Started(lambda: ran.append("now") or 1, beside=False)
    assert ran == ["now"]  # before the caller's next line
    assert started.result()[0] == 1

    def fails() -> None:
        raise ValueError("grader down")

    for beside in (True, False):
        with pytest.raises(ValueError, match="grader down"):
            Started(fails, beside=beside).result()
