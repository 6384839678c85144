"""The client commands' own input: a spec or grader file that cannot be read or parsed is one line
naming the file and why, exit 2, before anything is asked of a server (no traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from worker.cli import app

UNREACHABLE = "http://127.0.0.1:9"  # nothing listens there; the commands must not get that far


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("missing.json", None, "cannot read it (No such file or directory)"),
        ("bad.json", '{"model": ', "not valid JSON"),
        ("bad.yaml", "model: [tiny\n", "not valid YAML"),
        ("list.json", "[1, 2]", "must hold one job object"),
        ("latin1.json", '{"suffix": "caf\xe9"}'.encode("latin-1"), "not UTF-8 text (byte 15)"),
    ],
)
def test_a_spec_that_cannot_be_read_is_one_line_and_exit_2(tmp_path: Path, name, content, says) -> None:
    spec = tmp_path / name
    if isinstance(content, bytes):
        spec.write_bytes(content)
    elif content is not None:
        spec.write_text(content)
    result = CliRunner().invoke(
        app, ["jobs", "create", str(spec), "--base-url", UNREACHABLE], env={"RLOO_API_KEY": "sk-test"}
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {spec}") and says in lines[0], result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_grader_file_that_cannot_be_read_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["graders", "run", str(tmp_path / "nope.json"), "--sample", "x", "--base-url", UNREACHABLE],
        env={"RLOO_API_KEY": "sk-test"},
    )
    assert result.exit_code == 2 and "cannot read it" in result.output, result.output


@pytest.mark.parametrize(("command", "suggests"), [("up", "rloo up --port"), ("demo", "make demo PORT=")])
def test_a_port_in_use_is_found_before_anything_starts(tmp_path: Path, command: str, suggests: str) -> None:
    """A second `rloo up` or `make demo` on a taken port (by another stack, or another program) says
    so and which port to take instead, and exits 1, before it builds, migrates or starts anything."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, [command, "--port", str(port)], env={"RLOO_HOME": str(tmp_path / "home")})
    assert result.exit_code == 1, result.output
    assert f"port {port} on 127.0.0.1 is in use" in result.output and suggests in result.output, result.output
    assert "is up" not in result.output and not (tmp_path / "home").exists()  # nothing started


def test_an_address_this_machine_does_not_have_is_one_line_not_a_port_in_use(tmp_path: Path) -> None:
    """Only EADDRINUSE is a port in use: an address that is not this machine's (192.0.2.1, TEST-NET:
    bound to, never sent to) is said as such, and no other port is offered."""
    result = CliRunner().invoke(app, ["up", "--host", "192.0.2.1", "--port", "8000"], env={"RLOO_HOME": str(tmp_path)})
    assert result.exit_code == 1, result.output
    assert "cannot listen on 192.0.2.1:8000" in result.output and "in use" not in result.output, result.output
    assert not any(tmp_path.iterdir())  # nothing started


def test_only_a_missing_table_is_a_database_without_schema() -> None:
    """PostgreSQL says "does not exist" of a missing database or role too: those are not a missing
    schema (the driver's own error stands); its undefined_table code is."""
    from worker.cli.admin import _missing_table

    class PgError(Exception):
        def __init__(self, text: str, sqlstate: str) -> None:
            super().__init__(text)
            self.sqlstate = sqlstate

    assert _missing_table(Exception("no such table: api_keys"))  # SQLite
    assert _missing_table(PgError('relation "api_keys" does not exist', "42P01"))
    assert not _missing_table(PgError('database "rloo" does not exist', "3D000"))
    assert not _missing_table(PgError('role "rloo" does not exist', "28000"))


def test_a_key_asked_of_a_database_with_no_schema_says_to_upgrade_it(tmp_path: Path) -> None:
    """`rloo keys create` before the first `rloo up` or `rloo db upgrade`: one line, exit 1."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"} | {"RLOO_HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "keys", "create", "--project", "p"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "has no schema yet: run `rloo db upgrade`" in out.stderr and out.stdout == ""


def test_rloo_train_says_on_stderr_what_a_jobs_first_events_would(
    tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rloo train` runs the API's checks; the notes the API puts in a job's first events (a model
    without a chat template, a batch over the file's lines) go to its stderr (stdout: the steps)."""
    import json
    import shutil

    from service.core.settings import get_settings
    from worker.engine.standalone import spec_config

    plain = tmp_path / "models" / "no-template"
    shutil.copytree(models_dir / "tiny-policy", plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' * 3)
    spec = tmp_path / "job.json"
    grader = {"type": "string_check", "name": "s", "input": "{{sample.output_text}}", "reference": "{{item.answer}}"}
    reinforcement = {"grader": grader | {"operation": "eq"}, "hyperparameters": {"batch_size": 4}}
    job = {"model": "no-template", "training_file": "train.jsonl", "method": {"type": "reinforcement"}}
    job["method"]["reinforcement"] = reinforcement
    spec.write_text(json.dumps(job))
    monkeypatch.setenv("RLOO_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("RLOO_HOME", str(tmp_path / "home"))
    get_settings.cache_clear()
    try:
        spec_config(spec, overrides={})
    finally:
        get_settings.cache_clear()
    out = capsys.readouterr()
    notes = [line for line in out.err.splitlines() if line.startswith("note: ")]
    assert out.out == "" and len(notes) == 2, out
    assert "no chat template" in notes[0] and "batch_size 4 is more than the 3 line(s)" in notes[1], notes
