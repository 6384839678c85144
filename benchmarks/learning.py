"""Does RLOO's baseline earn its keep? Four advantage estimators and TRL's RLOOTrainer on a task a
tiny model really learns (``examples/addition``: two-digit sums, reward 1 for the exact answer).

Sections, all on the models ``examples/addition/build.py`` builds in a fresh ``RLOO_HOME``:

* ``learning``: ``examples/addition/job.json`` (600 steps, 16 problems x 8 samples) for each
  ``advantage_estimator`` and seed, in this process through ``rloo train``'s own path. The held-out
  accuracy (the job's validation pass: one sample at temperature 1 on each of 500 held-out
  problems) every 50 steps, as the run records it; the final checkpoint's and the supervised
  start's over ``EVAL_REPEATS`` such passes; the final accuracy (mean +- standard error over
  seeds), the steps to reach ``THRESHOLD``, how often the gradient was clipped. Same seeds, same
  compute for each estimator.
* ``gradient_variance``: at fixed weights (the supervised start, and the RLOO seed-0 run's
  checkpoints), ``VARIANCE_BATCHES`` fresh batches are sampled, and each estimator's policy gradient
  (the engine's loss at ratio 1) is taken on the same rollouts. Per estimator: the total variance
  over batches (the trace of the covariance), the squared norm of the mean gradient (less its
  noise), their ratio (noise to signal of one batch), the mean gradient's norm and cosine against
  RLOO's, and a bias statistic against plain REINFORCE (an unbiased estimator): the paired mean
  difference's squared norm over its expected size under no bias (about 1 when unbiased). Also plain
  REINFORCE with every reward raised by 1 (a reward whose zero is elsewhere), and, from each
  completion's own gradient on the first ``SCORE_BATCHES`` batches, the constant baseline that
  would minimise the variance against the mean reward a group baseline estimates.
* ``trl``: TRL's ``RLOOTrainer`` (trl 1.16, the ``bench`` extra) on the same model, problems,
  reward and settings, the same seeds; its saved weights scored by the same validation pass.
* ``through_api``: the RLOO seed-0 job through the HTTP API (a local stack on the embedded
  defaults), its metrics against the in-process run's, step by step.

``make bench-learning`` (``python -m benchmarks.learning [--seeds N] [--steps N] [--sections ...]``)
prints one JSON object and draws ``benchmarks/learning.png``; ``benchmarks/RESULTS.md`` keeps the
figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Collect
from worker.engine.metrics import TIMING_METRICS

EXAMPLE = ROOT / "examples" / "addition"
JOB = EXAMPLE / "job.json"
ESTIMATORS = ("rloo", "grpo", "reinforce", "reinforce_mean")
SHIFTED = "reinforce_reward_plus_1"
"""Plain REINFORCE on the same rollouts with every reward raised by 1 (variance section only): a
reward whose zero is not where failures sit. The three baselines are blind to such a shift."""
THRESHOLD = 0.3
EVAL_REPEATS = 4
"""Validation passes of a final checkpoint (each 500 problems, one sample, its own sampling seed, the
same seeds for every checkpoint so that runs are compared on the same draws): 2,000 samples a run,
where one pass's accuracy has a binomial error of about 2 points."""
VARIANCE_BATCHES = 128
SCORE_BATCHES = 4
"""Batches a point whose completions' gradients are also taken one by one (the optimal baseline)."""
PICTURE = Path(__file__).resolve().parent / "learning.png"
SECTIONS = ("learning", "variance", "trl", "api")


def job_settings() -> dict[str, Any]:
    return dict(json.loads(JOB.read_text())["method"]["reinforcement"]["hyperparameters"])


def mean_se(values: list[float]) -> dict[str, Any]:
    """Mean and standard error of the mean (n - 1 in the variance; None for one value)."""
    n = len(values)
    se = round(statistics.stdev(values) / math.sqrt(n), 4) if n > 1 else None
    return {"mean": round(statistics.fmean(values), 4), "se": se, "n": n}


@contextlib.contextmanager
def quiet() -> Any:
    """Stderr to /dev/null: a run's events, which the benchmark does not read."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        yield


# ---------------------------------------------------------------- learning
def accuracy(checkpoint: Path | None, repeats: int = EVAL_REPEATS) -> float:
    """The held-out accuracy of ``checkpoint`` (None: the supervised start): the mean of ``repeats``
    of the validation pass a run makes, with sampling seeds 10000, 10001, ... whatever the run."""
    from worker.engine.standalone import evaluate_spec

    scores = []
    for r in range(repeats):
        with quiet():
            result = evaluate_spec(JOB, overrides={}, checkpoint=checkpoint, seed=10_000 + r)
        scores.append(float(result["valid_reward_mean"]))
    return statistics.fmean(scores)


def ours(estimator: str, seed: int, out: Path, steps: int, checkpoint_interval: int = 0) -> dict[str, Any]:
    """One run of job.json with ``estimator``, through ``rloo train``'s path (``run_spec``)."""
    from worker.engine.standalone import run_spec

    rec = Collect(quiet=True)
    overrides = {"advantage_estimator": estimator, "max_steps": steps, "checkpoint_interval": checkpoint_interval}
    with quiet():
        summary = run_spec(JOB, overrides=overrides, output_dir=out, recorder=rec, seed=seed)
    if summary["status"] != "succeeded":
        raise RuntimeError(f"{estimator} seed {seed}: {summary}")
    return {
        "final": accuracy(Path(summary["final_checkpoint"])),
        "wall_s": summary["wall_s"],
        "grad_norms": [m["grad_norm"] for m in rec.steps],
        "entropy": [m["entropy"] for m in rec.steps],
        "curve": [(m["step"], m["valid_reward_mean"]) for m in rec.steps if m.get("valid_reward_mean") is not None],
        "rewards": [m["train_reward_mean"] for m in rec.steps],
        "steps": rec.steps,
        "overrides": overrides,
    }


def difference(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean final accuracy of ``a`` less ``b``'s (runs of the same seeds, in order), with the
    standard error of the per-seed differences (paired: our runs of one seed share their data order
    and first rollouts) and of a difference of independent means (unpaired), and ``t`` = the
    difference over the paired error (4 degrees of freedom for 5 seeds: |t| > 2.78 is p < 0.05)."""
    finals_a, finals_b = [r["final"] for r in a], [r["final"] for r in b]
    paired = mean_se([x - y for x, y in zip(finals_a, finals_b, strict=True)])
    x, y = mean_se(finals_a), mean_se(finals_b)
    unpaired = math.hypot(x["se"], y["se"]) if x["se"] is not None and y["se"] is not None else None
    return {
        "difference": paired["mean"],
        "se_paired": paired["se"],
        "se_unpaired": round(unpaired, 4) if unpaired is not None else None,
        "t": round(paired["mean"] / paired["se"], 2) if paired["se"] else None,
    }


def steps_to(start: float, curve: list[tuple[int, float]], threshold: float) -> int | None:
    """The first step whose accuracy reached ``threshold``: 0 if the start had, else the first
    evaluated step (None: never)."""
    return next((step for step, value in [(0, start), *curve] if value >= threshold), None)


def summarise(runs: list[dict[str, Any]], start: float) -> dict[str, Any]:
    """Over seeds: the final accuracy (``EVAL_REPEATS`` passes of the final checkpoint), the gain
    over the start, steps to the threshold (on the run's own passes), the curve, the clipping."""
    finals = [r["final"] for r in runs]
    reached = [steps_to(start, r["curve"], THRESHOLD) for r in runs]
    curve_steps = [step for step, _ in runs[0]["curve"]]
    return {
        "final_accuracy": mean_se(finals),
        "gain_over_start": mean_se([f - start for f in finals]),
        # The mean and s.e. are over the seeds that reached it (a conditional mean: see "reached").
        f"steps_to_{THRESHOLD}": {
            "reached": f"{sum(r is not None for r in reached)}/{len(reached)}",
            **(mean_se([float(r) for r in reached if r is not None]) if any(r is not None for r in reached) else {}),
        },
        "train_reward_first_last_50": [
            round(statistics.fmean(statistics.fmean(r["rewards"][:50]) for r in runs), 3),
            round(statistics.fmean(statistics.fmean(r["rewards"][-50:]) for r in runs), 3),
        ],
        "curve": {
            "steps": [0, *curve_steps],
            "mean": [round(start, 4)]
            + [round(statistics.fmean(r["curve"][i][1] for r in runs), 4) for i in range(len(curve_steps))],
            "se": [0.0] + [mean_se([r["curve"][i][1] for r in runs])["se"] for i in range(len(curve_steps))],
        },
        # Gradients past max_grad_norm (1) are clipped to it: a constant factor on the advantages
        # changes which steps clip, the one way it reaches AdamW's update.
        "grad_norm_median": round(statistics.median(g for r in runs for g in r["grad_norms"]), 3),
        "steps_not_clipped": f"{sum(g <= 1.0 for r in runs for g in r['grad_norms'])} of "
        f"{sum(len(r['grad_norms']) for r in runs)}",
        "entropy_first_last_50": [
            round(statistics.fmean(statistics.fmean(r["entropy"][:50]) for r in runs), 3),
            round(statistics.fmean(statistics.fmean(r["entropy"][-50:]) for r in runs), 3),
        ]
        if all(r.get("entropy") for r in runs)
        else None,
        "finals": [round(f, 4) for f in finals],
        "wall_s_median": round(statistics.median(r["wall_s"] for r in runs), 1),
    }


# ---------------------------------------------------------------- gradient variance
@dataclasses.dataclass
class Moments:
    """Running sums of flat gradient vectors: enough for the mean and the trace of the covariance."""

    total: Any = None
    squares: float = 0.0
    n: int = 0

    def add(self, g: Any) -> None:
        g = g.double()  # the variance is a difference of two large sums
        self.total = g.clone() if self.total is None else self.total + g
        self.squares += float(g.double().pow(2).sum())
        self.n += 1

    @property
    def mean(self) -> Any:
        return self.total / self.n

    @property
    def variance(self) -> float:
        """The trace of the covariance over the batches (n - 1 in the denominator)."""
        return (self.squares - self.n * float(self.mean.double().pow(2).sum())) / (self.n - 1)

    @property
    def signal(self) -> float:
        """``||E g||^2``, without the bias of ``||mean||^2`` (which carries ``variance / n`` of noise)."""
        return float(self.mean.double().pow(2).sum()) - self.variance / self.n


def gradient_stats(
    moments: dict[str, Moments], paired: dict[str, Moments], known_scale: dict[str, float]
) -> dict[str, Any]:
    """Per estimator: the variance, signal, their ratio; the scale of its expected gradient against
    RLOO's, estimated (the square root of the signals' ratio: noise-free, unlike the sample means'
    norms) and, where the math fixes it, known (``known_scale``: 1 for the unbiased ones, ``(k-1)/k``
    for the mean baseline; an estimate there would only add noise); the variance at an equal scale
    (by the known scale where there is one); the cosine of the sample means; and the bias statistic
    against REINFORCE's (``paired[e]`` holds ``g_e - g_reinforce`` per batch)."""
    import torch

    ref, rloo = moments["rloo"].mean, moments["rloo"]
    out: dict[str, Any] = {}
    for name, m in moments.items():
        estimated = math.sqrt(m.signal / rloo.signal) if m.signal > 0 and rloo.signal > 0 else None
        scale = known_scale.get(name, estimated)
        d = paired.get(name)
        bias = None
        if d is not None and d.variance > 0:
            bias = round(float(d.mean.double().pow(2).sum()) / (d.variance / d.n), 2)
        out[name] = {
            "variance": m.variance,
            "signal": m.signal,
            "noise_to_signal": round(m.variance / m.signal, 2) if m.signal > 0 else None,
            "variance_vs_rloo": round(m.variance / rloo.variance, 3),
            "scale_vs_rloo_estimated": round(estimated, 3) if estimated else None,
            "scale_vs_rloo_known": known_scale.get(name),
            # At an equal scale: a constant factor on the advantages (reinforce_mean's (k-1)/k, much
            # of GRPO's 1/std) scales signal and noise alike, and a clipped or AdamW update does not see it.
            "variance_vs_rloo_same_scale": round(m.variance / rloo.variance / scale**2, 3) if scale else None,
            "cosine_to_rloo": round(float(torch.nn.functional.cosine_similarity(m.mean, ref, dim=0)), 3),
            "bias_statistic_vs_reinforce": bias,
        }
    return out


def constant_baselines(moments: dict[str, Moments], paired: dict[str, Moments], mean_reward: float) -> dict[str, Any]:
    """The variance of REINFORCE with a constant baseline ``b``, exactly, from three variances over
    the same batches: ``g(b) = g_r - b * g_1`` with ``g_r`` REINFORCE's gradient and ``g_1`` the one
    of advantages all 1 (``paired[SHIFTED]``: REINFORCE on reward + 1 less REINFORCE), so
    ``Var g(b) = Var g_r - 2 b C + b^2 Var g_1`` with ``C`` their covariance's trace. Against RLOO's
    variance: no baseline, the batches' mean reward (what a group's mean estimates, but known
    exactly), and the best constant ``C / Var g_1``. RLOO's own excess over the mean's is what
    estimating each prompt's mean from its other k-1 samples costs (and gains)."""
    var_r, var_1 = moments["reinforce"].variance, paired[SHIFTED].variance
    cov = (moments[SHIFTED].variance - var_r - var_1) / 2
    best = cov / var_1

    def at(b: float) -> float:
        return round((var_r - 2 * b * cov + b * b * var_1) / moments["rloo"].variance, 3)

    return {
        "mean_reward": round(mean_reward, 4),
        "best_constant": round(best, 4),
        "variance_vs_rloo": {"none": at(0.0), "mean_reward": at(mean_reward), "best_constant": at(best)},
    }


def gradient_variance(points: dict[int, Path | None], batches: int = VARIANCE_BATCHES) -> dict[str, Any]:
    """``gradient_stats`` at each point (step -> checkpoint; None: the supervised start)."""
    import torch

    if batches < 2:
        raise ValueError("the gradient variance needs at least 2 batches a point")

    from worker.engine.data import batch_indices, prompt_text
    from worker.engine.methods import policy_gradient as rloo
    from worker.engine.prepare import prepare
    from worker.engine.rewards.scoring import score_batch
    from worker.engine.rollout.base import completion_logprobs
    from worker.engine.standalone import spec_config

    out: dict[str, Any] = {}
    for step, checkpoint in points.items():
        print(f"gradient variance at step {step}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as scratch, quiet():
            cfg = spec_config(JOB, overrides={}, output_dir=Path(scratch), seed=0)
            if checkpoint is not None:
                cfg = dataclasses.replace(cfg, init_from=(checkpoint,))
            run = prepare(cfg, Collect(quiet=True))
        hp = run.rl
        if hp.loss_aggregation != "sequence_sum":
            raise ValueError(
                "the score norms below are of summed log-probs: job.json's loss_aggregation is sequence_sum"
            )
        known = {"rloo": 1.0, "reinforce": 1.0, SHIFTED: 1.0, "reinforce_mean": (hp.rloo_k - 1) / hp.rloo_k}
        reward_total = 0.0
        sums: dict[str, float] = {}
        moments = {name: Moments() for name in (*ESTIMATORS, SHIFTED)}
        paired = {name: Moments() for name in moments if name != "reinforce"}
        run.model.train()
        for b in range(batches):
            indices = batch_indices(n_items=len(run.items), batch_size=hp.batch_size, step=b, seed=10_007 + step)
            items = [run.items[i] for i in indices]
            prompts = [prompt_text(item, run.tokenizer) for item in items]
            ro = run.sampler.generate(prompts, k=hp.rloo_k, generator_seed=1_000_003 * (step + 1) + b)
            graded = score_batch(
                run.scorer,
                prompts=[p for p in prompts for _ in range(hp.rloo_k)],
                texts=ro.texts,
                items=[item for item in items for _ in range(hp.rloo_k)],
                reward_models=None,
            )
            rewards = torch.tensor(graded.rewards, dtype=torch.float32).view(hp.batch_size, hp.rloo_k)
            reward_total += float(rewards.mean())
            mask = ro.completion_mask.to(torch.float32)
            logp, _ = completion_logprobs(run.model, ro, temperature=hp.temperature)
            grads: dict[str, Any] = {}
            for name in moments:
                adv = (
                    rloo.advantages(rewards + 1, "reinforce") if name == SHIFTED else rloo.advantages(rewards, name)
                ).view(-1)
                loss, _ = rloo.policy_loss(logp, logp.detach(), adv, mask, aggregation=hp.loss_aggregation)
                parts = torch.autograd.grad(loss, run.params, retain_graph=True, allow_unused=True)
                grads[name] = torch.cat(
                    [
                        (g if g is not None else torch.zeros_like(p)).flatten()
                        for g, p in zip(parts, run.params, strict=True)
                    ]
                )
                moments[name].add(grads[name])
            for name, m in paired.items():
                m.add(grads[name] - grads["reinforce"])
            if b < SCORE_BATCHES:
                sums = score_norms(run, logp, mask, rewards.view(-1), sums)
        out[str(step)] = {
            "batches": batches,
            **gradient_stats(moments, paired, known),
            "constant_baselines": constant_baselines(moments, paired, reward_total / batches),
            "score_norms": optimal_baseline(sums),
        }
    return out


def score_norms(run: Any, logp: Any, mask: Any, rewards: Any, sums: dict[str, float]) -> dict[str, float]:
    """``sums`` plus this batch's: per completion ``s = ||grad log pi(y)||^2`` (one backward each),
    summed with ``r * s``, ``r``, and split by correct (reward 1) and wrong."""
    import torch

    sequence = (logp * mask).sum(dim=-1)
    out = dict(sums)
    for i in range(sequence.numel()):
        parts = torch.autograd.grad(sequence[i], run.params, retain_graph=True, allow_unused=True)
        s = float(sum(g.double().pow(2).sum() for g in parts if g is not None))
        r = float(rewards[i])
        for key, value in (("n", 1.0), ("s", s), ("rs", r * s), ("r", r)):
            out[key] = out.get(key, 0.0) + value
        side = "right" if r > 0.5 else "wrong"
        out[f"n_{side}"] = out.get(f"n_{side}", 0.0) + 1
        out[f"s_{side}"] = out.get(f"s_{side}", 0.0) + s
    return out


def optimal_baseline(sums: dict[str, float]) -> dict[str, Any]:
    """From single completions: the constant ``b`` that minimises the variance of one completion's
    ``(r - b) grad log pi`` (``E[r s] / E[s]`` with ``s = ||grad log pi||^2``, the squared score
    norm) against the mean reward, and how much larger a wrong completion's ``s`` is than a right
    one's. (``constant_baselines`` gives the batch estimator's variance at any constant exactly.)"""
    mean_reward = sums["r"] / sums["n"]
    right = sums.get("s_right", 0.0) / sums["n_right"] if sums.get("n_right") else None
    wrong = sums.get("s_wrong", 0.0) / sums["n_wrong"] if sums.get("n_wrong") else None
    return {
        "completions": int(sums["n"]),
        "mean_reward": round(mean_reward, 4),
        "best_constant_one_completion": round(sums["rs"] / sums["s"], 4),
        "squared_score_norm_wrong_over_right": round(wrong / right, 2) if right and wrong else None,
    }


# ---------------------------------------------------------------- TRL
def trl(seed: int, out: Path, steps: int) -> dict[str, Any]:
    """TRL's RLOOTrainer on job.json's model, problems, reward and settings; its weights saved at
    each of our evaluation steps and scored by the same validation pass."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import RLOOTrainer

    from benchmarks.common import trl_config
    from service.core.settings import get_settings
    from worker.engine.data import load_items
    from worker.engine.standalone import evaluate_spec

    hf_logging.set_verbosity_error()
    hp = job_settings()
    every = hp["eval_interval"]
    model_dir = get_settings().models_dir / json.loads(JOB.read_text())["model"]

    def exact_match(completions: list[list[dict[str, str]]], answer: list[str], **_: Any) -> list[float]:
        return [float(c[0]["content"] == a) for c, a in zip(completions, answer, strict=True)]

    class SaveAtEvalSteps(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % every == 0 or state.global_step == steps:
                kwargs["model"].save_pretrained(out / f"step-{state.global_step}")
                tok.save_pretrained(out / f"step-{state.global_step}")

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [{"prompt": item["messages"], "answer": item["answer"]} for item in load_items(EXAMPLE / "train.jsonl")]
    args = trl_config(
        out / "trainer",
        seed=seed,
        steps=steps,
        learning_rate=hp["learning_rate"],
        k=hp["rloo_k"],
        prompts=hp["batch_size"],
        new_tokens=hp["max_new_tokens"],
        beta=hp["kl_coef"],
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[SaveAtEvalSteps()],
    )
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its logs; stdout is for our JSON
        trainer.train()
    wall = time.perf_counter() - t0
    curve = []
    for step in sorted(int(p.name[5:]) for p in out.glob("step-*")):
        with quiet():
            score = evaluate_spec(JOB, overrides={}, checkpoint=out / f"step-{step}", seed=seed)
        curve.append((step, score["valid_reward_mean"]))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    grad_norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    entropy = [h["entropy"] for h in trainer.state.log_history if "entropy" in h]
    final = accuracy(out / f"step-{steps}")
    return {
        "wall_s": wall,
        "curve": curve,
        "rewards": rewards,
        "final": final,
        "grad_norms": grad_norms,
        "entropy": entropy,
    }


# ---------------------------------------------------------------- through the API
def through_api(reference: list[dict[str, Any]], overrides: dict[str, Any]) -> dict[str, Any]:
    """The seed-0 RLOO job (job.json, ``overrides`` on its hyperparameters) through HTTP on a local
    stack; its metrics against ``reference`` (the same job's in-process run): every step's every
    metric but the timings."""
    import httpx

    from worker.cli.stack import Stack

    os.environ["RLOO_RATE_LIMIT"] = "0"
    stack = Stack("127.0.0.1", _free_port(), quiet=True)
    key = stack.start()
    try:
        http = httpx.Client(base_url=stack.url + "/v1", headers={"Authorization": f"Bearer {key}"}, timeout=60)
        body = json.loads(JOB.read_text())
        for which in ("training_file", "validation_file"):
            path = EXAMPLE / body[which]
            r = http.post("/files", files={"file": (path.name, path.read_bytes())}, data={"purpose": "fine-tune"})
            r.raise_for_status()
            body[which] = r.json()["id"]
        body["method"]["reinforcement"]["hyperparameters"].update(overrides)
        r = http.post("/fine_tuning/jobs", json=body)
        r.raise_for_status()
        job_id = r.json()["id"]
        t0 = time.perf_counter()
        while (job := http.get(f"/fine_tuning/jobs/{job_id}").json())["status"] not in (
            "succeeded",
            "failed",
            "cancelled",
        ):
            if time.perf_counter() - t0 > 3600:
                raise RuntimeError(f"job {job_id} still {job['status']} after an hour")
            time.sleep(1)
        if job["status"] != "succeeded":
            raise RuntimeError(f"job {job_id} {job['status']}: {job['error']}")
        wall = time.perf_counter() - t0
        metrics = http.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"]
    finally:
        stack.stop()
    diffs: dict[str, float] = {}
    for api_row, ours_row in zip(metrics, reference, strict=True):
        for name, value in ours_row.items():
            if name in TIMING_METRICS or not isinstance(value, (int, float)):
                continue
            other = api_row.get(name)
            diff = abs(float(other) - float(value)) if isinstance(other, (int, float)) else math.inf
            diffs[name] = max(diffs.get(name, 0.0), diff)
    valid = [(m["step"], m["valid_reward_mean"]) for m in metrics if m.get("valid_reward_mean") is not None]
    return {
        "job_id": job_id,
        "steps": len(metrics),
        "submit_to_succeeded_s": round(wall, 1),
        "valid_reward_mean": valid,
        "metrics_compared": len(diffs),
        "largest_difference": max(diffs.values()) if diffs else None,
        "differing_metrics": sorted(name for name, d in diffs.items() if d > 0),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- the picture
COLOURS = {
    "rloo": "#1f77b4",
    "grpo": "#2ca02c",
    "reinforce": "#d62728",
    "reinforce_mean": "#9467bd",
    SHIFTED: "#ff9896",
    "trl": "#7f7f7f",
}


def draw(result: dict[str, Any], path: Path) -> None:
    """Left: held-out accuracy over steps, each run's own passes, mean over seeds with a band of one
    standard error, per estimator and TRL; at the end, each one's final accuracy (4 passes of the
    final checkpoint) with its standard error. Right: each estimator's gradient variance against
    RLOO's at an equal scale, at each point of the RLOO run, as bars up or down from 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    runs = {**result["learning"], **({"trl": result["trl"]} if "trl" in result else {})}
    last = max(step for summary in runs.values() for step in summary["curve"]["steps"])
    for i, (name, summary) in enumerate(runs.items()):
        curve, colour = summary["curve"], COLOURS[name]
        errors = [se or 0.0 for se in curve["se"]]  # None: one seed
        lo = [m - e for m, e in zip(curve["mean"], errors, strict=True)]
        hi = [m + e for m, e in zip(curve["mean"], errors, strict=True)]
        final = summary["final_accuracy"]
        label = f"{name} (final {final['mean']:.1%})"
        left.plot(curve["steps"], curve["mean"], color=colour, label=label, linewidth=2 if name == "rloo" else 1.2)
        left.fill_between(curve["steps"], lo, hi, color=colour, alpha=0.15)
        left.errorbar(
            last * (1.03 + 0.012 * i), final["mean"], yerr=final["se"] or 0.0, color=colour, marker="o", markersize=4
        )
    left.axhline(THRESHOLD, color="black", linestyle=":", linewidth=0.8)
    left.set_xlabel("RL step (16 problems x 8 samples); dots: final checkpoint, 4 passes")
    left.set_ylabel("held-out accuracy (one sample, T=1, 500 problems)")
    left.set_title(f"Two-digit addition, mean +- s.e. over {result['seeds']} seeds")
    left.legend(loc="lower right", fontsize=8)
    left.grid(alpha=0.3)
    variance = result["gradient_variance"]
    points = list(variance)
    names = (*ESTIMATORS, SHIFTED)
    width = 0.8 / len(names)
    shown = []
    for i, name in enumerate(names):
        values = [variance[p][name]["variance_vs_rloo_same_scale"] or math.nan for p in points]  # None: no signal
        shown += [v for v in values if math.isfinite(v)]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(points))]
        right.bar(
            xs,
            [v - 1 for v in values],
            bottom=1,
            width=width,
            color=COLOURS[name],
            label=name,
            hatch="//" if name == SHIFTED else None,
        )
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xticks(range(len(points)), [f"step {p}" for p in points])
    right.set_yscale("log")
    low, high = math.floor(math.log2(min(shown, default=1))), math.ceil(math.log2(max(shown, default=1)))
    ticks = [2.0**e for e in range(min(low, -1), max(high, 1) + 1)]
    right.set_yticks(ticks, [f"{t:g}" for t in ticks])
    right.set_yticks([], minor=True)
    right.set_ylabel("gradient variance / RLOO's, at an equal scale")
    right.set_title(f"Gradient variance at fixed weights ({variance[points[0]]['batches']} batches)")
    right.legend(fontsize=8)
    right.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=job_settings()["max_steps"])
    parser.add_argument("--batches", type=int, default=VARIANCE_BATCHES, help="batches per gradient-variance point")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, of {', '.join(SECTIONS)}: variance and api run RLOO's seed 0 without learning, "
        "trl RLOO's every seed (its comparison); the picture needs learning and variance",
    )
    parser.add_argument("--picture", type=Path, default=PICTURE)
    args = parser.parse_args(argv)
    sections = {name.strip() for name in args.sections.split(",") if name.strip()}
    if not sections <= set(SECTIONS):
        parser.error(f"--sections: unknown {', '.join(sorted(sections - set(SECTIONS)))}; use {', '.join(SECTIONS)}")

    home = Path(tempfile.mkdtemp(prefix="rloo-bench-learning-"))
    for name in ("DATABASE_URL", "RLOO_DATABASE_URL", "REDIS_URL", "RLOO_REDIS_URL", "RLOO_MODELS_DIR"):
        os.environ.pop(name, None)
    os.environ["RLOO_HOME"] = str(home)  # read by every settings lookup below: a fresh home of its own
    import torch

    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "task": "examples/addition: 2-digit sums, 1500 supervised examples (400 steps), then RL on 8000 problems",
        "settings": {**job_settings(), "max_steps": args.steps},
        "seeds": args.seeds,
        "threshold": THRESHOLD,
    }
    try:
        t0 = time.perf_counter()
        build = subprocess.run(
            [sys.executable, str(EXAMPLE / "build.py")], capture_output=True, text=True, env=os.environ
        )
        if build.returncode:
            raise RuntimeError(f"examples/addition/build.py failed:\n{build.stderr[-3000:]}")
        result["build_s"] = round(time.perf_counter() - t0, 1)
        seeds = list(range(args.seeds)) if sections & {"learning", "trl"} else [0]
        start = accuracy(None)
        samples = EVAL_REPEATS * 500
        # The sampling error on these 500 problems (4 samples each); the problems are a fixed set.
        result["before_rl"] = {"mean": round(start, 4), "se": round(math.sqrt(start * (1 - start) / samples), 4)}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ESTIMATORS}
        for seed in seeds:  # seed-major: drift in the machine's speed hits every estimator alike
            for name in ESTIMATORS if "learning" in sections else ("rloo",):
                print(f"{name} seed {seed}", file=sys.stderr, flush=True)
                interval = max(1, args.steps // 3) if (name, seed) == ("rloo", 0) else 0  # the variance points
                runs[name].append(ours(name, seed, home / "runs" / f"{name}-{seed}", args.steps, interval))
        if "learning" in sections:
            result["learning"] = {name: summarise(rs, start) for name, rs in runs.items()}
            result["vs_rloo_final"] = {name: difference(runs[name], runs["rloo"]) for name in ESTIMATORS[1:]}
        if "variance" in sections:
            rloo_run = home / "runs" / "rloo-0"
            points: dict[int, Path | None] = {0: None}
            points.update({int(p.name[5:]): p for p in sorted(rloo_run.glob("step-*"), key=lambda p: int(p.name[5:]))})
            result["gradient_variance"] = gradient_variance(points, args.batches)
        if "trl" in sections:
            trl_runs = []
            for seed in seeds:
                print(f"trl seed {seed}", file=sys.stderr, flush=True)
                trl_runs.append(trl(seed, home / "trl" / str(seed), args.steps))
            result["trl"] = summarise(trl_runs, start)
            result["rloo_minus_trl_final"] = difference(runs["rloo"], trl_runs)
        if "api" in sections:
            print("seed 0 through the HTTP API", file=sys.stderr, flush=True)
            reference = runs["rloo"][0]
            result["through_api"] = through_api(reference["steps"], reference["overrides"])
        if {"learning", "variance"} <= sections:
            draw(result, args.picture)
            result["picture"] = str(
                args.picture.relative_to(ROOT) if args.picture.is_relative_to(ROOT) else args.picture
            )
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
