"""tinker-cookbook's supervised loop, then its RL loop from where it ended, against a running stack,
with the figures at the end (``make tinker-examples`` runs this in the project's venv, after
``make up``):

    python examples/tinker/run.py [--base-url http://127.0.0.1:8000]

1. ``build.py``: the base model ``arith-base`` under the models root (kept if it is there).
2. A key the Tinker SDK accepts: ``TINKER_API_KEY``, or a new ``--tinker`` key of project
   ``tinker-examples`` (``rloo keys create``, on the stack's database: run it where ``rloo up`` runs).
3. ``cookbook.py sl_loop``, then ``cookbook.py math_rl`` from sl_loop's final state, in the cookbook's
   venv (``.venv-tinker``), each as its own process: the recipes unmodified, ``TINKER_BASE_URL`` set.
4. What they learned, from the cookbook's own ``metrics.jsonl``: the supervised loss (the mean NLL of
   an answer's tokens) and the RL reward (the share of sums right), at the start and the end, with a
   line of each curve. The dashboard's "Tinker runs" draws both runs' losses a step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RUNS = ROOT / "var" / "tinker"
COOKBOOK_PYTHON = Path(os.environ.get("TINKER_COOKBOOK_PYTHON", ROOT / ".venv-tinker" / "bin" / "python"))
"""The cookbook's venv (``make tinker-venv``), or ``TINKER_COOKBOOK_PYTHON``: a python that has
``tinker==0.38.0`` and ``tinker-cookbook==0.5.8``."""
BARS = "▁▂▃▄▅▆▇█"


def tinker_key() -> str:
    if os.environ.get("TINKER_API_KEY"):
        return os.environ["TINKER_API_KEY"]
    made = subprocess.run(
        [sys.executable, "-m", "worker.cli", "keys", "create", "--project", "tinker-examples", "--tinker"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        raise SystemExit(
            f"{made.stderr.strip()}\nStart the stack first (make up), or set TINKER_API_KEY to a --tinker key of it."
        )
    return made.stdout.strip().splitlines()[-1]


def metrics(run: str) -> list[dict[str, float]]:
    return [json.loads(line) for line in (RUNS / run / "metrics.jsonl").read_text().splitlines()]


def curve(values: list[float], width: int = 40) -> str:
    """One line of bars, each the mean of its share of ``values``."""
    if not values:
        return ""
    n = min(width, len(values))
    chunks = [values[i * len(values) // n : (i + 1) * len(values) // n] for i in range(n)]
    means = [sum(c) / len(c) for c in chunks]
    low, high = min(means), max(means)
    return "".join(BARS[round((m - low) / (high - low) * 7) if high > low else 0] for m in means)


def ends(values: list[float], n: int) -> tuple[float, float]:
    """The mean of the first ``n`` and of the last ``n`` values."""
    return sum(values[:n]) / n, sum(values[-n:]) / n


def summary() -> str:
    sl = [row["train_mean_nll"] for row in metrics("sl_loop")]
    rl = [row["env/all/correct"] for row in metrics("math_rl")]
    n_sl, n_rl = max(1, len(sl) // 10), max(1, len(rl) // 5)
    (sl0, sl1), (rl0, rl1) = ends(sl, n_sl), ends(rl, n_rl)
    return (
        f"sl_loop  {len(sl)} steps: mean NLL of an answer token {sl0:.2f} -> {sl1:.2f} "
        f"(first and last {n_sl} steps)  {curve(sl)}\n"
        f"math_rl  {len(rl)} steps: sums right {rl0:.1%} -> {rl1:.1%} (first and last {n_rl} steps)  {curve(rl)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"))
    args = parser.parse_args(argv)
    if not COOKBOOK_PYTHON.exists():
        raise SystemExit(f"{COOKBOOK_PYTHON} is missing: make tinker-venv, or set TINKER_COOKBOOK_PYTHON")
    subprocess.run([sys.executable, str(HERE / "build.py")], cwd=ROOT, check=True)
    env = {**os.environ, "TINKER_BASE_URL": args.base_url, "TINKER_API_KEY": tinker_key()}
    for recipe in ("sl_loop", "math_rl"):
        shutil.rmtree(RUNS / recipe, ignore_errors=True)  # sl_loop would resume a run it finds there
        print(f"--- {recipe} against {args.base_url}", flush=True)
        subprocess.run([str(COOKBOOK_PYTHON), str(HERE / "cookbook.py"), recipe], cwd=ROOT, env=env, check=True)
    print(summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
