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
