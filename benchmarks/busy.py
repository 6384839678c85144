"""Our engine against TRL's ``RLOOTrainer`` on a busy machine: the *tiny* config of ``benchmarks.anchor``
(same model files, prompts, reward and settings) while a fixed background load runs.

The load: ``--busy N`` processes (default 2.5 a usable core, rounded: 5 on 2 cores, a load average of
about 6) that spin in pure Python, started before the first run and stopped after the last. Each run
is a process of its own, so that its torch threads and OpenMP wait policy are set before torch is
imported, as the service's own processes set them:

* ``ours``: as ``rloo train`` and the workers run it (``worker.engine.cpu_threads`` with ``auto``);
* ``ours_torch_default``: our engine at torch's defaults (a thread per core, OpenMP's spinning wait):
  what every run of ours got before ``RLOO_TORCH_THREADS``;
* ``trl``: TRL as its users run it, at torch's defaults;
* ``trl_our_threads``: TRL with our choice of threads and wait policy, which any TRL user could set:
  what is left is the engines' own difference under load.

The four alternate, ``--rounds`` times each (round r with seed r), and the medians of their seconds a
step are compared. Run it with ``make bench`` (or ``python -m benchmarks.busy [--rounds=N]
[--busy=N]``); it prints one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, SETTINGS
from worker.engine.cpu_threads import usable_cores

CONFIG = "tiny"
STEPS = 20  # anchor's 40 would take ~5 minutes a round here: every run is several times slower
WHO = ("ours", "ours_torch_default", "trl", "trl_our_threads")
SPIN = "while True: pass"


def one(who: str, seed: int, where: Path) -> dict[str, Any]:
    """One run in this process: its seconds a step and its torch threads (a JSON line on stdout)."""
    if who in ("ours", "trl_our_threads"):
        from worker.engine.cpu_threads import configure

        configure("auto")
    import torch

    from benchmarks.anchor import trl
    from benchmarks.common import build, ours, plain_prompts

    build(where / "models", CONFIG)
    data = plain_prompts(where)
    run = (trl if who.startswith("trl") else ours)(
        where / "models", CONFIG, data, where / "out", seed=seed, steps=STEPS
    )
    return {"who": who, "seconds_a_step": run["wall_s"] / STEPS, "threads": torch.get_num_threads()}


def _run(who: str, seed: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GOMP_SPINCOUNT")}
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.busy", "--one", who, str(seed), tmp],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
        )
    if proc.returncode:
        raise SystemExit(f"{who}'s run failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def compare(rounds: int, busy: int) -> dict[str, Any]:
    load = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    runs: dict[str, list[dict[str, Any]]] = {who: [] for who in WHO}
    try:
        time.sleep(5)  # the load average begins to show it
        for r in range(rounds):
            for who in WHO:
                runs[who].append(_run(who, r))
                took = runs[who][-1]["seconds_a_step"]
                print(f"[busy {busy}] round {r + 1} (seed {r}): {who} {took:.3f} s a step", file=sys.stderr, flush=True)
        load_average = os.getloadavg()[0]
    finally:
        for p in load:
            p.kill()
            p.wait()
    out: dict[str, Any] = {"load_average_1min": round(load_average, 1)}
    for who, rs in runs.items():
        out[who] = {
            "seconds_a_step_median": round(statistics.median(r["seconds_a_step"] for r in rs), 3),
            "seconds_a_step": [round(r["seconds_a_step"], 3) for r in rs],
            "torch_threads": rs[0]["threads"],
        }
    step = {who: out[who]["seconds_a_step_median"] for who in WHO}
    out["speedup_over_trl"] = round(step["trl"] / step["ours"], 2)
    out["speedup_over_torch_default"] = round(step["ours_torch_default"] / step["ours"], 2)
    out["speedup_over_trl_our_threads"] = round(step["trl_our_threads"] / step["ours"], 2)
    return out


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--one"]:
        print(json.dumps(one(args[1], int(args[2]), Path(args[3]))))
        return
    options = dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--") and "=" in a)
    cores = usable_cores()
    busy = int(options.get("busy", round(2.5 * cores)))
    rounds = int(options.get("rounds", 3))
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "settings": f"{CONFIG}, {STEPS} steps; {SETTINGS}",
                "usable_cores": cores,
                "busy_processes": busy,
                "rounds": rounds,
                **compare(rounds, busy),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
