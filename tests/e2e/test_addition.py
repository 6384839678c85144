"""examples/addition, the task a model really learns: built as users build it; one run through
``rloo train`` and through the HTTP API gives the same numbers, and ``rloo score`` the same
validation pass; the learning benchmark's gradient statistics on vectors whose answer is known."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.helpers.data import EXAMPLES, ROOT
from tests.helpers.live import child_env, live_stack, upload_path, wait_for
from tests.helpers.training import TIMING

ADDITION = EXAMPLES / "addition"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("addition_build", ADDITION / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cli(home: Path, models: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m worker.cli ARGS`` as a user runs it, on ``home`` and ``models``."""
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        cwd=ROOT,
        env=child_env(home, models),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python examples/addition/build.py`` in a home of its own (30 supervised steps, not 400):
    the models root it built into."""
    home = tmp_path_factory.mktemp("addition")
    out = subprocess.run(
        [sys.executable, str(ADDITION / "build.py"), "--sft-steps", "30"],
        cwd=ROOT,
        env=child_env(home, home / "models"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "addition-sft: held-out accuracy" in out.stdout and "rloo train examples/addition/job.json" in out.stdout
    # Not a terminal: plain progress lines, not a bar that shows nothing until the end.
    progress = [line for line in out.stdout.splitlines() if line.startswith("supervised step ")]
    assert [line.split()[2] for line in progress] == [f"{n}/30" for n in range(1, 31)], progress
    assert "train_loss" in progress[-1] and "\x1b[" not in out.stdout
    return home / "models"


def test_every_sum_is_in_exactly_one_file_with_its_answer(built: Path) -> None:
    split = _example().problems()
    assert {name: len(rows) for name, rows in split.items()} == {"sft": 1500, "train": 8000, "valid": 500}
    seen: set[str] = set()
    for name, rows in split.items():
        assert [json.loads(line) for line in (ADDITION / f"{name}.jsonl").read_text().splitlines()] == rows
        for row in rows:
            question = row["messages"][0]["content"]
            a, b = (int(x) for x in question.rstrip("=").split("+"))
            answer = row["messages"][1]["content"] if name == "sft" else row["answer"]
            assert answer == str(a + b) and question not in seen
            seen.add(question)
    assert len(seen) == 100 * 100  # every a+b of 0..99, each once: no held-out sum is trained on


def test_the_supervised_start_loads_with_from_pretrained_one_token_a_character(built: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sft = built / "addition-sft"
    assert not list(sft.glob("training_state*"))  # a model, not a run: the training state stayed behind
    tok = AutoTokenizer.from_pretrained(sft)
    assert len(tok("12+34=", add_special_tokens=False).input_ids) == 6
    model = AutoModelForCausalLM.from_pretrained(sft)
    base = AutoModelForCausalLM.from_pretrained(built / "addition-base")
    assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)  # it was trained


def test_the_learning_benchmarks_exact_scores_agree_with_a_token_by_token_reading(built: Path) -> None:
    """``benchmarks.learning.scoring.held_out`` (batched, left-padded, through the engine's log-prob
    path) against each prompt alone, unpadded, token by token, and transformers' own greedy search."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.learning.scoring import held_out
    from benchmarks.learning.tasks import TASKS
    from worker.engine.data import prompt_text

    sft = built / "addition-sft"
    items = [json.loads(line) for line in (ADDITION / "valid.jsonl").read_text().splitlines()[:40]]
    scores = held_out(sft, TASKS["graded"], items, max_new_tokens=4)
    tok = AutoTokenizer.from_pretrained(sft)
    model = AutoModelForCausalLM.from_pretrained(sft).eval()
    configured = model.generation_config.eos_token_id
    eos = sorted({*(configured if isinstance(configured, list) else [configured]), tok.eos_token_id})
    expected = greedy = reward = 0.0
    with torch.no_grad():
        for item in items:
            prompt = tok(prompt_text(item, tok), add_special_tokens=False).input_ids
            seq, p = list(prompt), 1.0
            for token in [*tok(item["answer"], add_special_tokens=False).input_ids, None]:
                probs = torch.softmax(model(torch.tensor([seq])).logits[0, -1].double(), -1)
                if token is None:  # then any EOS
                    p *= float(sum(probs[e] for e in eos))
                else:
                    p *= float(probs[token])
                    seq.append(token)
            expected += p
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=4,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )
            text = tok.decode(out[0, len(prompt) :], skip_special_tokens=True)
            greedy += float(text == item["answer"])
            reward += TASKS["graded"].reward(text, item["answer"])
    n = len(items)
    assert 0 < scores["expected"] < 0.9  # a model that knows some sums: the comparison can fail
    assert scores["expected"] == pytest.approx(expected / n, abs=1e-5)
    assert scores["greedy"] == pytest.approx(greedy / n) and scores["greedy_reward"] == pytest.approx(reward / n)


@pytest.mark.e2e
def test_rloo_train_and_the_api_give_the_same_numbers_and_rloo_eval_the_same_validation_pass(
    tmp_path: Path, built: Path
) -> None:
    overrides = {"max_steps": 4, "eval_interval": 2, "eval_samples": 64, "rloo_k": 4, "batch_size": 4}
    sets = [arg for name, value in overrides.items() for arg in ("--set", f"{name}={value}")]
    out = _cli(tmp_path, built, "train", str(ADDITION / "job.json"), *sets, "--seed", "3")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    local, summary = lines[:-1], lines[-1]
    assert [m["step"] for m in local] == [1, 2, 3, 4]
    assert [m["step"] for m in local if "valid_reward_mean" in m] == [2, 4]

    # rloo score on the final checkpoint is the run's own last validation pass, exactly.
    scored = _cli(
        tmp_path, built, "score", str(ADDITION / "job.json"), "--checkpoint", summary["final_checkpoint"],
        "--set", "eval_samples=64", "--seed", "3",
    )  # fmt: skip
    assert scored.returncode == 0, scored.stderr
    result = json.loads(scored.stdout)
    assert result["samples"] == 64 and result["valid_reward_mean"] == local[-1]["valid_reward_mean"]

    (tmp_path / "stack").mkdir()
    with live_stack("embedded", tmp_path / "stack", built) as stack:
        http = stack.http
        body: dict[str, Any] = json.loads((ADDITION / "job.json").read_text())
        body["training_file"] = upload_path(http, ADDITION / "train.jsonl")
        body["validation_file"] = upload_path(http, ADDITION / "valid.jsonl")
        body["seed"] = 3
        body["method"]["reinforcement"]["hyperparameters"].update(overrides)
        r = http.post("/fine_tuning/jobs", json=body)
        assert r.status_code == 200, r.text
        job = wait_for(http, r.json()["id"], {"succeeded", "failed", "cancelled"}, 240, stack)
        assert job["status"] == "succeeded", job["error"]
        served = http.get(f"/fine_tuning/jobs/{job['id']}/metrics").json()["data"]

    def numbers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in m.items() if k not in TIMING and k != "created_at"} for m in rows]

    assert numbers(served) == numbers(local)  # every metric of every step, to the last bit


def test_rloo_score_refuses_what_it_cannot_score_and_its_old_name_still_works(tmp_path: Path, models_dir: Path) -> None:
    spec = tmp_path / "job.json"
    body = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    body["training_file"] = str(EXAMPLES / "demo" / "train.jsonl")
    spec.write_text(json.dumps(body))
    out = _cli(tmp_path, models_dir, "score", str(spec))
    assert out.returncode == 2 and "no validation_file" in out.stderr and "Traceback" not in out.stderr
    body["validation_file"] = str(EXAMPLES / "demo" / "valid.jsonl")
    spec.write_text(json.dumps(body))
    out = _cli(tmp_path, models_dir, "eval", str(spec), "--checkpoint", str(tmp_path))  # the old name, for a release
    assert out.returncode == 2 and "no model there" in out.stderr and "Traceback" not in out.stderr
    assert "`rloo eval` is now `rloo score`" in out.stderr


# ---------------------------------------------------------------- the benchmark's statistics
def _draws(
    truth: torch.Tensor, batches: int, recipe: dict[str, Any], seed: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``batches`` gradients per estimator, ``recipe[name](truth, noise, g)`` each from one shared
    unit noise; the moments and the moments of each one's difference from "reinforce"'s."""
    from benchmarks.learning.variance import Moments

    g = torch.Generator().manual_seed(seed)
    moments = {name: Moments() for name in recipe}
    paired = {name: Moments() for name in recipe if name != "reinforce"}
    for _ in range(batches):
        noise = torch.randn(truth.shape, generator=g, dtype=torch.float64)
        draws = {name: make(truth, noise, g) for name, make in recipe.items()}
        for name, value in draws.items():
            moments[name].add(value)
        for name in paired:
            paired[name].add(draws[name] - draws["reinforce"])
    return moments, paired


def test_gradient_statistics_compare_variances_at_an_equal_scale_even_where_noise_dominates() -> None:
    """2,000 coordinates, a small mean (squared norm 20) under unit noise (variance 2,000), 200
    batches: a sample mean's squared norm is half noise there, so scaling by it would call REINFORCE's
    three times RLOO's variance 1.8 times; the noise-free signal keeps it at 3."""
    from benchmarks.learning.variance import gradient_stats

    truth = torch.full((2000,), 0.1, dtype=torch.float64)
    moments, paired = _draws(
        truth,
        200,
        {
            "rloo": lambda t, n, g: t + n,
            "reinforce": lambda t, n, g: t + 3**0.5 * torch.randn(t.shape, generator=g, dtype=torch.float64),
            "reinforce_mean": lambda t, n, g: 0.75 * (t + n),
        },
    )
    stats = gradient_stats(moments, paired, {})  # every scale estimated
    assert stats["rloo"]["variance"] == pytest.approx(2000, rel=0.05)
    assert stats["rloo"]["signal"] == pytest.approx(20, rel=0.25)
    assert stats["reinforce"]["variance_vs_rloo"] == pytest.approx(3, rel=0.05)
    assert stats["reinforce"]["variance_vs_rloo_same_scale"] == pytest.approx(3, rel=0.2)
    assert stats["reinforce_mean"]["scale_vs_rloo_estimated"] == pytest.approx(0.75, abs=1e-6)  # same draws, shrunk
    assert stats["reinforce_mean"]["variance_vs_rloo_same_scale"] == pytest.approx(1.0, abs=1e-6)
    # Where the math fixes the scale, it is used: the estimate's noise stays out.
    known = gradient_stats(moments, paired, {"rloo": 1.0, "reinforce": 1.0})
    assert known["reinforce"]["variance_vs_rloo_same_scale"] == known["reinforce"]["variance_vs_rloo"]


def test_the_bias_statistic_is_about_1_without_bias_and_large_with_it() -> None:
    from benchmarks.learning.variance import gradient_stats

    truth = torch.randn(50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    moments, paired = _draws(
        truth,
        4000,
        {
            "rloo": lambda t, n, g: t + 0.5 * n,
            "reinforce": lambda t, n, g: t + torch.randn(t.shape, generator=g, dtype=torch.float64),
            "reinforce_mean": lambda t, n, g: 0.75 * (t + 0.5 * n),  # shrunk: biased
            "grpo": lambda t, n, g: t + 0.5 * n + 0.5,  # shifted: biased
        },
    )
    stats = gradient_stats(moments, paired, {})
    assert 0.5 < stats["rloo"]["bias_statistic_vs_reinforce"] < 2  # chi-square over its degrees: about 1
    assert stats["reinforce_mean"]["bias_statistic_vs_reinforce"] > 50
    assert stats["grpo"]["bias_statistic_vs_reinforce"] > 50


def test_constant_baselines_give_the_variance_at_any_constant_from_three_variances() -> None:
    """``g_r = t + 0.5 u + v`` (REINFORCE), ``g_1 = u`` (advantages all 1: mean zero), unit noises
    ``u, v`` in 200 coordinates; RLOO's variance 0.64 a coordinate. By hand, per coordinate:
    Var g_r = 1.25, Var g_1 = 1, their covariance 0.5, so the best constant is 0.5 and
    Var(g_r - b g_1) = 1.25 - b + b^2: 1.25 at 0, 1.09 at 0.2, 1.0 at 0.5; against RLOO's 0.64."""
    from benchmarks.learning.variance import SHIFTED, constant_baselines

    def reinforce(t: torch.Tensor, n: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        return t + 0.5 * n + torch.randn(t.shape, generator=g, dtype=torch.float64)

    truth = torch.full((200,), 0.3, dtype=torch.float64)
    draws: dict[str, Any] = {}

    def remember(name: str, make: Any) -> Any:
        def draw(t: torch.Tensor, n: torch.Tensor, g: torch.Generator) -> torch.Tensor:
            draws[name] = make(t, n, g)
            return draws[name]

        return draw

    moments, paired = _draws(
        truth,
        3000,
        {
            "rloo": lambda t, n, g: t + 0.8 * torch.randn(t.shape, generator=g, dtype=torch.float64),
            "reinforce": remember("reinforce", reinforce),
            SHIFTED: lambda t, n, g: draws["reinforce"] + n,  # reward + 1: g_r + g_1
        },
    )
    found = constant_baselines(moments, paired, mean_reward=0.2)
    assert found["best_constant"] == pytest.approx(0.5, abs=0.04)
    ratios = found["variance_vs_rloo"]
    assert ratios["none"] == pytest.approx(1.25 / 0.64, rel=0.05)
    assert ratios["mean_reward"] == pytest.approx(1.09 / 0.64, rel=0.05)
    assert ratios["best_constant"] == pytest.approx(1.0 / 0.64, rel=0.05)
