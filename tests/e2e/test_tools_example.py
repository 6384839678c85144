"""examples/tools, a model that learns to call a calculator: built as users build it (the worked
dialogues in OpenAI's tool-call format, learned by supervised training), then one RLOO run through
``rloo train`` with the built-in calculator and through the HTTP API with the same calculator served
over HTTP by the example's ``tool_server.py``: the same numbers, every metric of every step."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers.data import EXAMPLES, ROOT
from tests.helpers.live import child_env, live_stack, upload_path, wait_for
from tests.helpers.training import TIMING

TOOLS = EXAMPLES / "tools"
SFT_STEPS = 40


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python examples/tools/build.py --sft-steps 40`` in a home of its own: its models root."""
    home = tmp_path_factory.mktemp("tools")
    out = subprocess.run(
        [sys.executable, str(TOOLS / "build.py"), "--sft-steps", str(SFT_STEPS)],
        cwd=ROOT,
        env=child_env(home, home / "models"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr
    assert "held-out accuracy with the calculator" in out.stdout
    return home / "models"


def test_the_data_holds_each_problem_once_with_its_answer_and_uploads_as_chat(tmp_path: Path) -> None:
    from service.files.datasets import store_jsonl

    split = _module("build").problems()
    seen: set[str] = set()
    for name in ("sft", "train", "valid"):
        for row in split[name]:
            question = row["messages"][0]["content"]
            assert question not in seen
            seen.add(question)
            a, op, b = question.rstrip("=").partition("+") if "+" in question else question.rstrip("=").partition("*")
            answer = str(int(a) + int(b) if op == "+" else int(a) * int(b))
            assert all(4 <= len(x) <= 6 for x in (a, b))
            if name == "sft":
                call = row["messages"][1]["tool_calls"][0]["function"]
                assert json.loads(call["arguments"]) == {"expression": question.rstrip("=")}
                assert row["messages"][2] == {"role": "tool", "tool_call_id": "call_0", "content": answer}
                assert row["messages"][3]["content"] == answer
            else:
                assert row["answer"] == answer
    with open(TOOLS / "sft.jsonl", "rb") as src:  # the upload's own checks: OpenAI's chat format with tools
        summary = store_jsonl(src, dest=tmp_path / "sft-check.jsonl", max_bytes=2**28, max_line_bytes=2**20)
    assert summary.formats == {"chat": 2000} and summary.lines == 2000


@pytest.mark.e2e
def test_rloo_train_with_the_builtin_and_the_api_with_the_http_tool_give_the_same_numbers(
    tmp_path: Path, built: Path
) -> None:
    overrides = {"max_steps": 2, "eval_interval": 2, "eval_samples": 16, "rloo_k": 4, "batch_size": 4}
    sets = [arg for name, value in overrides.items() for arg in ("--set", f"{name}={value}")]
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "train", str(TOOLS / "job.json"), *sets, "--seed", "3"],
        cwd=ROOT,
        env=child_env(tmp_path, built),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    local = [json.loads(line) for line in out.stdout.splitlines()][:-1]
    assert [m["step"] for m in local] == [1, 2]
    assert local[0]["tool_calls_mean"] > 0  # the supervised start calls the calculator (over HTTP in the API run)
    assert "valid_tool_calls_mean" in local[-1]

    server = _module("tool_server").serve(0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prefix = f"http://127.0.0.1:{server.server_port}/"
    (tmp_path / "stack").mkdir()
    try:
        with live_stack("embedded", tmp_path / "stack", built, env={"RLOO_TOOL_URLS": json.dumps([prefix])}) as stack:
            http = stack.http
            body: dict[str, Any] = json.loads((TOOLS / "job_http.json").read_text())
            body["training_file"] = upload_path(http, TOOLS / "train.jsonl")
            body["validation_file"] = upload_path(http, TOOLS / "valid.jsonl")
            body["seed"] = 3
            body["method"]["reinforcement"]["tools"][0]["runtime"]["url"] = prefix + "calculator"
            body["method"]["reinforcement"]["hyperparameters"].update(overrides)
            r = http.post("/fine_tuning/jobs", json=body)
            assert r.status_code == 200, r.text
            job = wait_for(http, r.json()["id"], {"succeeded", "failed", "cancelled"}, 240, stack)
            assert job["status"] == "succeeded", job["error"]
            served = http.get(f"/fine_tuning/jobs/{job['id']}/metrics").json()["data"]
    finally:
        server.shutdown()
        server.server_close()

    def numbers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in m.items() if k not in TIMING and k != "created_at"} for m in rows]

    assert numbers(served) == numbers(local)  # every metric of every step, to the last bit
