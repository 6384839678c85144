"""Client commands: any rloo-service server over HTTP (``--base-url`` / ``RLOO_BASE_URL``, ``--api-key``
/ ``RLOO_API_KEY``), with no torch to import (but for ``checkpoints download --merge``).

``rloo files upload|list``, ``rloo jobs create|list|get|cancel|pause|resume|watch``,
``rloo checkpoints list|download``, ``rloo graders run``. Objects print as JSON, lists as tables.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Annotated, Any

import typer

from worker.cli.app import app
from worker.cli.http import Api, fail
from worker.cli.watch import watch

files_app = typer.Typer(help="Files on a server (over HTTP).", no_args_is_help=True, rich_markup_mode=None)
jobs_app = typer.Typer(help="Fine-tuning jobs on a server (over HTTP).", no_args_is_help=True, rich_markup_mode=None)
ckpt_app = typer.Typer(help="A job's checkpoints (over HTTP).", no_args_is_help=True, rich_markup_mode=None)
graders_app = typer.Typer(help="Try a grader on a server (over HTTP).", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(files_app, name="files")
app.add_typer(jobs_app, name="jobs")
app.add_typer(ckpt_app, name="checkpoints")
app.add_typer(graders_app, name="graders")

BaseUrl = Annotated[str | None, typer.Option(metavar="URL", help="The server's /v1 URL (RLOO_BASE_URL).")]
ApiKey = Annotated[str | None, typer.Option(metavar="KEY", help="An API key (RLOO_API_KEY).")]
JobId = Annotated[str, typer.Argument(metavar="JOB_ID")]


def _show(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2))


def _table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A table on a terminal; tab-separated lines, whole, for a script."""
    from rich.console import Console
    from rich.table import Table

    cells = [["" if row.get(c) is None else str(row.get(c)) for c in columns] for row in rows]
    console = Console()
    if not console.is_terminal:
        for line in [columns, *cells]:
            typer.echo("\t".join(line))
        return
    table = Table(*columns)
    for line in cells:
        table.add_row(*line)
    console.print(table)


# Files ---------------------------------------------------------------------------------------------
def upload(api: Api, path: Path, purpose: str = "fine-tune") -> dict[str, Any]:
    if not path.is_file():
        fail(f"no file {path}")
    with path.open("rb") as f:
        return api.call("POST", "/files", files={"file": (path.name, f)}, data={"purpose": purpose})  # type: ignore[no-any-return]


@files_app.command("upload")
def files_upload(
    path: Annotated[Path, typer.Argument(metavar="PATH")],
    purpose: Annotated[str, typer.Option(metavar="PURPOSE")] = "fine-tune",
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Upload a JSONL training or validation file.

    \b
    Example:
      rloo files upload train.jsonl
    """
    _show(upload(Api(base_url, api_key), path, purpose))


@files_app.command("list")
def files_list(base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """The project's files, newest first."""
    rows = Api(base_url, api_key).call("GET", "/files")["data"]
    _table(rows, ["id", "filename", "bytes", "purpose", "created_at"])


# Jobs ----------------------------------------------------------------------------------------------
def _spec(path: Path | None) -> dict[str, Any]:
    """The job a spec file holds (JSON, or YAML by its suffix); a file that cannot be read or parsed
    is one line naming it and why, exit 2."""
    if path is None:
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        fail(f"{path}: cannot read it ({exc.strerror})", code=2)
    except UnicodeDecodeError as exc:
        fail(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 JSON or YAML", code=2)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            fail(f"{path}: not valid YAML ({' '.join(str(exc).split())})", code=2)
    else:
        try:
            loaded = json.loads(text)
        except ValueError as exc:
            fail(f"{path}: not valid JSON ({exc})", code=2)
    if not isinstance(loaded, dict):
        fail(f"{path} must hold one job object", code=2)
    return dict(loaded)


def _file_id(api: Api, value: str, base: Path) -> str:
    """A file id as is; a local path (relative to the spec) uploaded first."""
    for candidate in (Path(value), base / value):
        if candidate.is_file():
            uploaded = upload(api, candidate)
            typer.echo(f"uploaded {candidate} as {uploaded['id']}", err=True)
            return str(uploaded["id"])
    return value


@jobs_app.command("create")
def jobs_create(
    spec: Annotated[Path | None, typer.Argument(metavar="SPEC", help="A job as JSON or YAML (the API's body).")] = None,
    model: Annotated[str | None, typer.Option(metavar="MODEL")] = None,
    training_file: Annotated[str | None, typer.Option(metavar="FILE", help="A file id, or a path to upload.")] = None,
    validation_file: Annotated[str | None, typer.Option(metavar="FILE")] = None,
    suffix: Annotated[str | None, typer.Option(metavar="SUFFIX")] = None,
    seed: Annotated[int | None, typer.Option(metavar="N")] = None,
    follow: Annotated[bool, typer.Option("--watch", help="Follow the job until it ends.")] = False,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Create a job from a spec and/or flags; files named by a local path are uploaded first.

    \b
    Examples:
      rloo jobs create examples/demo/job.json --training-file examples/demo/train.jsonl --watch
      rloo jobs create --model tiny-policy --training-file file-abc    # supervised, OpenAI's default
    """
    body = _spec(spec)  # before anything is asked of the server
    api = Api(base_url, api_key)
    given = {"model": model, "training_file": training_file, "validation_file": validation_file}
    body.update({k: v for k, v in {**given, "suffix": suffix, "seed": seed}.items() if v is not None})
    base = spec.parent if spec is not None else Path(".")
    for key in ("training_file", "validation_file"):
        if isinstance(body.get(key), str):
            body[key] = _file_id(api, body[key], base)
    job = api.call("POST", "/fine_tuning/jobs", json=body)
    if not follow:
        _show(job)
        return
    typer.echo(f"created {job['id']}", err=True)
    raise typer.Exit(watch(api, job["id"]))


@jobs_app.command("list")
def jobs_list(
    limit: Annotated[int, typer.Option(metavar="N")] = 20, base_url: BaseUrl = None, api_key: ApiKey = None
) -> None:
    """The project's jobs, newest first."""
    rows = Api(base_url, api_key).call("GET", "/fine_tuning/jobs", params={"limit": limit})["data"]
    for row in rows:
        progress = row.get("progress") or {}
        row["progress"] = f"{progress.get('step', 0)}/{progress.get('total_steps', '?')}"
        row["method"] = (row.get("method") or {}).get("type")
    _table(rows, ["id", "status", "method", "model", "progress", "fine_tuned_model"])


@jobs_app.command("get")
def jobs_get(job_id: JobId, base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """One job, as JSON."""
    _show(Api(base_url, api_key).call("GET", f"/fine_tuning/jobs/{job_id}"))


def _verb(verb: str) -> Any:
    def command(job_id: JobId, base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
        job = Api(base_url, api_key).call("POST", f"/fine_tuning/jobs/{job_id}/{verb}")
        typer.echo(f"{job['id']} {job['status']}")

    command.__doc__ = f"{verb.capitalize()} a job."
    return command


for _name in ("cancel", "pause", "resume"):
    jobs_app.command(_name)(_verb(_name))


@jobs_app.command("watch")
def jobs_watch(job_id: JobId, base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """Follow a job live until it ends: exit code 0 succeeded, 1 failed, 2 cancelled.

    \b
    Example:
      rloo jobs watch ftjob-abc123
    """
    raise typer.Exit(watch(Api(base_url, api_key), job_id))


# Checkpoints ---------------------------------------------------------------------------------------
@ckpt_app.command("list")
def checkpoints_list(job_id: JobId, base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """A job's checkpoints, newest first."""
    rows = Api(base_url, api_key).call("GET", f"/fine_tuning/jobs/{job_id}/checkpoints", params={"limit": 100})
    _table(rows["data"], ["id", "step_number", "fine_tuned_model_checkpoint", "created_at"])


@ckpt_app.command("download")
def checkpoints_download(
    job_id: JobId,
    directory: Annotated[Path, typer.Argument(metavar="DIR")],
    step: Annotated[
        int | None, typer.Option(metavar="N", help="The checkpoint of step N (default: the newest).")
    ] = None,
    merge: Annotated[bool, typer.Option(help="A LoRA checkpoint: write the full model, adapter folded in.")] = False,
    base: Annotated[
        Path | None, typer.Option(metavar="DIR", help="With --merge: the base model (default: the adapter's own).")
    ] = None,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Download a checkpoint into DIR, loadable with from_pretrained.

    \b
    Examples:
      rloo checkpoints download ftjob-abc123 ./model
      rloo checkpoints download ftjob-abc123 ./merged --step 40 --merge --base ./models/Qwen2.5-0.5B
    """
    api = Api(base_url, api_key)
    ckpts = api.call("GET", f"/fine_tuning/jobs/{job_id}/checkpoints", params={"limit": 100})["data"]
    chosen = [c for c in ckpts if step is None or c["step_number"] == step]
    if not chosen:
        fail(f"job {job_id} has no checkpoint{f' at step {step}' if step is not None else ''}")
    ckpt = chosen[0]
    archive = _download(api, f"/fine_tuning/jobs/{job_id}/checkpoints/{ckpt['id']}/content")
    target = directory / "adapter" if merge else directory
    _unpack(archive, target)
    if merge:
        _merge(target, base, directory)
    typer.echo(f"step {ckpt['step_number']} of {job_id} in {directory}")


def _download(api: Api, path: str) -> bytes:
    from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

    data = io.BytesIO()
    with (
        api.http.stream("GET", path) as r,
        Progress(*Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn()) as bar,
    ):
        if r.is_error:
            r.read()
            fail(f"{r.status_code}: {r.text[:300]}")
        task = bar.add_task("download", total=int(r.headers.get("content-length", 0)) or None)
        for chunk in r.iter_bytes():
            data.write(chunk)
            bar.advance(task, len(chunk))
    return data.getvalue()


def _unpack(archive: bytes, directory: Path) -> None:
    """The archive's files (``<ckpt id>/<name>``) straight into ``directory``; nothing outside it."""
    directory.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if not member.isfile() or name in ("", ".", ".."):
                continue
            source = tar.extractfile(member)
            if source is not None:
                (directory / name).write_bytes(source.read())


def _merge(adapter: Path, base: Path | None, out: Path) -> None:
    if not (adapter / "adapter_config.json").is_file():
        fail("this checkpoint is a full model already: download it without --merge")
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_path = base or Path(PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path or "")
    if not base_path.is_dir():
        fail(f"the base model {base_path} is not a directory here; pass --base DIR")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), adapter).merge_and_unload()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(
        adapter if (adapter / "tokenizer_config.json").is_file() else base_path
    ).save_pretrained(out)


# Graders -------------------------------------------------------------------------------------------
@graders_app.command("run")
def graders_run(
    grader: Annotated[Path, typer.Argument(metavar="GRADER.json")],
    sample: Annotated[str, typer.Option(metavar="TEXT", help="The completion to grade.")],
    item: Annotated[str, typer.Option(metavar="JSON", help="The training line it answers.")] = "{}",
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Run a grader on one sample on the server's graders worker.

    \b
    Example:
      rloo graders run grader.json --sample "Paris" --item '{"answer": "Paris"}'
    """
    try:
        body = {"grader": json.loads(grader.read_text()), "model_sample": sample, "item": json.loads(item)}
    except OSError as exc:
        fail(f"{grader}: cannot read it ({exc.strerror})", code=2)
    except ValueError as exc:
        fail(f"the grader file and --item must be JSON: {exc}", code=2)
    _show(Api(base_url, api_key).call("POST", "/fine_tuning/alpha/graders/run", json=body))
