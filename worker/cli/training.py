"""``rloo train`` (one job in the foreground, no API or broker) and ``rloo demo``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from worker.cli.app import app, torch_threads


def parse_set(pairs: list[str]) -> dict[str, Any]:
    """``--set key=value`` pairs; a value is read as JSON where it is JSON (``4``, ``true``, ``[1]``)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set takes key=value; got '{pair}'")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


SeedOption = Annotated[
    int | None, typer.Option(metavar="N", help="The job's seed, over the spec's (sampling, data order).")
]
DeviceOption = Annotated[str | None, typer.Option(metavar="DEVICE", help="cpu or cuda; default: cuda when present.")]
SetOption = Annotated[
    list[str] | None, typer.Option("--set", metavar="KEY=VALUE", help="Override a hyperparameter (repeatable).")
]


@app.command("train")
def train_cmd(
    spec: Annotated[
        Path,
        typer.Argument(
            metavar="SPEC.json",
            help="The job-creation body (docs/api.md), training_file and validation_file as local JSONL paths.",
        ),
    ],
    set_: SetOption = None,
    output_dir: Annotated[Path | None, typer.Option(metavar="DIR", help="Checkpoints go here.")] = None,
    device: DeviceOption = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR", help="Continue from this checkpoint directory (a step-N of an earlier run of the same spec)."
        ),
    ] = None,
    seed: SeedOption = None,
) -> None:
    """Run one job in this process, no API or broker: one JSON line per step, then a JSON summary.

    \b
    Examples:
      rloo train examples/demo/job.json --set max_steps=20
      rloo train job.json --output-dir runs/a --resume runs/a/step-10
    """
    torch_threads()
    from worker.engine.standalone import SpecError, run_spec

    try:
        summary = run_spec(
            spec,
            overrides=parse_set(set_ or []),
            output_dir=output_dir,
            device=device,
            resume_from=resume,
            seed=seed,
        )
    except SpecError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(summary))
    if summary.get("status") != "succeeded":
        raise typer.Exit(1)


@app.command("score")
def score_cmd(
    spec: Annotated[
        Path,
        typer.Argument(metavar="SPEC.json", help="A reinforcement job's body, with a validation_file (a local path)."),
    ],
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR", help="Score this model directory (e.g. a run's step-N) instead of the spec's model."
        ),
    ] = None,
    set_: SetOption = None,
    seed: SeedOption = None,
    device: DeviceOption = None,
) -> None:
    """Score a model on the spec's validation file as a run's validation pass does: one JSON object.

    valid_reward_mean over eval_samples prompts, one completion each at the job's sampling settings,
    seeded by its seed: a run's value at step N is this on its step-N checkpoint.

    Named apart from ``rloo evals`` (evaluations the server runs); ``rloo eval``, its name until
    this release, still works and says so.

    \b
    Examples:
      rloo score examples/addition/job.json
      rloo score examples/addition/job.json --checkpoint runs/a/step-600
    """
    torch_threads()
    from worker.engine.recorders import json_safe
    from worker.engine.standalone import SpecError, evaluate_spec

    try:
        result = evaluate_spec(spec, overrides=parse_set(set_ or []), checkpoint=checkpoint, device=device, seed=seed)
    except SpecError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(json_safe(result)))  # NaN (nothing could be scored) is null


@app.command("eval", hidden=True, deprecated=True)
def eval_cmd(
    spec: Annotated[Path, typer.Argument(metavar="SPEC.json")],
    checkpoint: Annotated[Path | None, typer.Option(metavar="DIR")] = None,
    set_: SetOption = None,
    seed: SeedOption = None,
    device: DeviceOption = None,
) -> None:
    """``rloo score``'s name until this release (one letter from ``rloo evals``); it goes in the next."""
    typer.echo("note: `rloo eval` is now `rloo score`; the old name goes in the next release", err=True)
    score_cmd(spec, checkpoint=checkpoint, set_=set_, seed=seed, device=device)


@app.command("demo")
def demo(
    port: Annotated[int, typer.Option(metavar="PORT", help="Port the demo's API listens on.")] = 8000,
    set_: SetOption = None,
) -> None:
    """Build tiny models offline, start the stack, run a real RLOO job over HTTP and show it.

    \b
    Examples:
      rloo demo --port 8123
      rloo demo --set max_steps=10
    """
    from worker.cli.demo import run_demo
    from worker.cli.stack import port_free_or_exit

    port_free_or_exit("127.0.0.1", port, "make demo PORT={free} (rloo demo --port {free})")
    raise typer.Exit(run_demo(port=port, overrides=parse_set(set_ or [])))
