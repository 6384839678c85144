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
    ],
)
def test_a_spec_that_cannot_be_read_is_one_line_and_exit_2(tmp_path: Path, name, content, says) -> None:
    spec = tmp_path / name
    if content is not None:
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
