"""``make gpu-check`` (``benchmarks/gpu_check.py``) on a host without a GPU: it says so and exits 0;
``--cpu-smoke`` runs its code path (the model built offline, ``rloo train`` in a process of its own,
the memory probe, the figures) with a tiny model for 2 steps and writes what a GPU run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cpu_smoke_writes_the_figures(tmp_path: Path) -> None:
    proc = _check("--cpu-smoke", "--out", str(tmp_path / "check.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| CPU, transformers | ok |" in proc.stdout
    assert (tmp_path / "check.md").read_text() == proc.stdout
    result = json.loads((tmp_path / "check.json").read_text())
    assert result["model"]["parameters"] > 0 and result["settings"]["max_steps"] == 2
    [run] = result["runs"]
    assert run["status"] == "ok", run
    assert (run["steps"], run["timed_steps"]) == (2, 1)  # step 1 is the warm-up
    assert run["generated_tokens_per_s"] > 0
    split = run["step_split_s_median"]
    assert set(split) == {"generate", "score", "reference", "update", "step"}
    assert min(split.values()) >= 0 and split["step"] >= split["generate"] + split["update"] > 0
    flops = run["step_flops"]
    assert flops["total"] == flops["generate"] + flops["reference"] + flops["update"] > 0
    assert run["achieved_tflops_per_s"]["step"] > 0
    assert run["mfu"] is None  # no peak for a CPU
    memory = run["memory"]
    assert set(memory["estimate_parts_mib"]) >= {"weights", "optimizer", "activations", "runtime"}
    assert memory["estimate_mib"] > 0
    assert memory["measured_peak_mib"] > 100  # a process with torch loaded
    expected = 100 * (memory["estimate_mib"] - memory["measured_peak_mib"]) / memory["measured_peak_mib"]
    assert abs(memory["error_pct"] - expected) < 0.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the check itself")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    proc = _check("--out", str(tmp_path / "check.json"))
    assert proc.returncode == 0
    assert "no CUDA device here" in proc.stderr
    assert not (tmp_path / "check.json").exists()
