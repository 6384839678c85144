"""docs/migrating-from-openai.md's worked example, run as a team would run it after moving: the
OpenAI pipeline of ``examples/migrating/pipeline.py`` (upload, a supervised job, a reinforcement job
with a ``multi`` grader on it, an eval of the base model against the fine-tuned one, a chat), through
the unmodified ``openai`` SDK, changed only in its base URL, key and model names, against a live stack
(the API, a training worker, an inference worker); then ``rloo evals get`` shows the two runs side
by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.data import EXAMPLES, ROOT
from tests.helpers.live import live_stack

pytestmark = pytest.mark.e2e


def test_the_openai_pipeline_runs_unchanged_but_for_base_url_and_model_names(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path
) -> None:
    with live_stack("embedded", tmp_path_factory.mktemp("migrating"), models_dir) as stack:
        stack.start("serve", "worker", "--serve")
        env = {
            **os.environ,
            "OPENAI_BASE_URL": stack.url + "/v1",
            "OPENAI_API_KEY": stack.key,
            "BASE_MODEL": "tiny-policy",
            "EPOCHS": "8",
            "LR_MULTIPLIER": "300",
            "PYTHONWARNINGS": "ignore::DeprecationWarning",  # the SDK's notice that OpenAI's Evals closed
        }
        out = subprocess.run(
            [sys.executable, str(EXAMPLES / "migrating" / "pipeline.py")],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=600,
        )
        assert out.returncode == 0, out.stdout + out.stderr + stack.log_tail()
        print(out.stdout)
        result = json.loads(out.stdout.splitlines()[-1])
        where = ("--base-url", stack.url + "/v1", "--api-key", stack.key)
        # The same eval from the command line: a third run of the base model on a local file, waited for.
        items = str(EXAMPLES / "migrating" / "eval_items.jsonl")
        question = ("--template", "{{ item.question }}", "--temperature", "0", "--max-tokens", "8")
        third = stack.cli(
            "evals", "runs", "create", result["eval"], "--file", items, "--model", "tiny-policy", *question, *where
        )
        third_row = third.stdout.splitlines()[-1].split("\t")
        assert third_row[1:4] == ["tiny-policy", "completed", "16"], third.stdout
        failed = stack.cli("evals", "runs", "output-items", result["eval"], third_row[0], "--status", "fail", *where)
        assert failed.stdout.splitlines()[0].split("\t") == ["item", "status", "output", "exact", "near"]
        table = stack.cli("evals", "get", result["eval"], *where)
    ft = result["fine_tuned_model"]
    assert ft.startswith("ft:tiny-policy:") and result["reinforcement_job"] in ft
    assert set(result["pass_rates"]) == {"tiny-policy", ft}
    for rates in result["pass_rates"].values():
        assert set(rates) == {"exact", "near"} and all(0 <= v <= 1 for v in rates.values())
    base, tuned = result["pass_rates"]["tiny-policy"], result["pass_rates"][ft]
    assert tuned["exact"] > base["exact"], result  # 8 epochs of the answers: 44% against 0% when written
    assert isinstance(result["chat"], str) and result["chat"]
    rows = [line.split("\t") for line in table.stdout.splitlines()]
    assert rows[0] == ["id", "model", "status", "items", "passed", "exact", "near"]
    runs = [(r[1], r[2], r[3]) for r in rows[1:]]
    assert runs == [("tiny-policy", "completed", "16"), (ft, "completed", "16"), ("tiny-policy", "completed", "16")]
    assert rows[3][4:] == rows[1][4:]  # the base model, greedy, seed 42: the pipeline's run again
    print(table.stdout)
