"""Artifacts on disk: uploaded files and checkpoints, all confined to their roots.

Every path that reaches the database is relative to the artifacts root; every path read back is
resolved and checked to lie inside that root, so a tampered row cannot point outside it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from service.errors import APIError, bad_request


def confined(root: Path, relative: str | Path) -> Path:
    """``root / relative`` resolved, or ValueError if it escapes ``root`` (``..``, absolute, symlinks)."""
    root = root.resolve()
    rel = Path(relative)
    if rel.is_absolute():
        raise ValueError(f"'{relative}' is an absolute path; name it relative to {root}")
    path = (root / rel).resolve()
    if path != root and root not in path.parents:
        raise ValueError(f"'{relative}' points outside {root}")
    return path


class UploadSummary:
    def __init__(self) -> None:
        self.lines = 0
        self.bytes = 0
        self.key_counts: dict[str, int] = {}
        self.first_missing: dict[str, int] = {}

    def add(self, lineno: int, keys: set[str]) -> None:
        for key in keys:
            if key not in self.key_counts:
                self.key_counts[key] = 0
                if lineno > 1:  # earlier lines lacked it
                    self.first_missing.setdefault(key, 1)
            self.key_counts[key] += 1
        for key in self.key_counts:
            if key not in keys:
                self.first_missing.setdefault(key, lineno)

    def as_dict(self) -> dict[str, Any]:
        return {"keys": self.key_counts, "first_missing": self.first_missing}


def check_line(obj: Any, lineno: int) -> set[str]:
    """Validate one parsed JSONL line; returns the keys graders may use as ``item.<key>``."""
    if not isinstance(obj, dict):
        raise bad_request(f"Line {lineno} is a JSON {type(obj).__name__}, not an object.", "file", "invalid_file")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise bad_request(f"Line {lineno}: 'messages' must be a non-empty list.", "file", "invalid_file")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise bad_request(
                    f"Line {lineno}: messages[{i}] must be an object with string 'role' and 'content'.",
                    "file",
                    "invalid_file",
                )
        if msgs[-1]["role"] != "user":
            raise bad_request(
                f"Line {lineno}: the last message must be a user turn (the model answers it); "
                f"got role '{msgs[-1]['role']}'.",
                "file",
                "invalid_file",
            )
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise bad_request(f"Line {lineno}: 'prompt' must be a non-empty string.", "file", "invalid_file")
    else:
        raise bad_request(
            f"Line {lineno} has neither 'messages' nor 'prompt'; each line needs one of them.", "file", "invalid_file"
        )
    return set(obj) - {"messages", "prompt"}


def _read_lines(
    source: IO[bytes], out: IO[bytes], summary: UploadSummary, *, max_bytes: int, max_line_bytes: int, chunk: int
) -> Iterator[tuple[int, bytes]]:
    """Yield ``(line number, raw line)`` from ``source``, copying every byte to ``out``."""
    pending = b""
    lineno = 0
    while block := source.read(chunk):
        summary.bytes += len(block)
        if summary.bytes > max_bytes:
            raise APIError(
                413, f"The file is larger than the limit of {max_bytes} bytes.", param="file", code="file_too_large"
            )
        out.write(block)
        *complete, pending = (pending + block).split(b"\n")
        for raw in complete:
            lineno += 1
            yield lineno, raw
        if len(pending) > max_line_bytes:
            raise bad_request(f"Line {lineno + 1} is over the limit of {max_line_bytes} bytes.", "file", "invalid_file")
    if pending:
        yield lineno + 1, pending


def store_jsonl(
    source: IO[bytes], *, dest: Path, max_bytes: int, max_line_bytes: int, chunk: int = 1 << 20
) -> UploadSummary:
    """Copy ``source`` to ``dest`` while validating it line by line.

    Written under a temporary name in the destination folder and renamed into place only when every
    line is valid: on any error nothing is left behind.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    summary = UploadSummary()
    fd, tmp_name = tempfile.mkstemp(prefix=".upload-", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            blank_at: int | None = None
            for lineno, raw in _read_lines(
                source, out, summary, max_bytes=max_bytes, max_line_bytes=max_line_bytes, chunk=chunk
            ):
                if len(raw) > max_line_bytes:
                    raise bad_request(
                        f"Line {lineno} is {len(raw)} bytes, over the limit of {max_line_bytes}.",
                        "file",
                        "invalid_file",
                    )
                if not raw.strip():
                    blank_at = blank_at or lineno
                    continue
                if blank_at is not None:
                    raise bad_request(f"Line {blank_at} is empty; remove blank lines.", "file", "invalid_file")
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    raise bad_request(
                        f"Line {lineno} is not valid UTF-8; save the file as UTF-8.", "file", "invalid_file"
                    ) from None
                except json.JSONDecodeError as exc:
                    raise bad_request(f"Line {lineno} is not valid JSON: {exc.msg}.", "file", "invalid_file") from None
                summary.add(summary.lines + 1, check_line(obj, lineno))
                summary.lines += 1
        if summary.lines == 0:
            raise bad_request("The file is empty: it needs at least one JSONL line.", "file", "invalid_file")
        tmp.replace(dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return summary


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def resolve_model(models_dir: Path, name: str, *, hub_offline: bool, param: str) -> Path | str:
    """A job's ``model`` as a directory under the models root (or a hub id where a hub is reachable)."""
    if not name or "\x00" in name:
        raise bad_request("Give the model as a directory name under the models root.", param)
    if Path(name).is_absolute() or name.startswith("~"):
        raise bad_request(
            f"Model '{name}' is an absolute path; name the model directory relative to the models root "
            "(RLOO_MODELS_DIR).",
            param,
        )
    try:
        path = confined(models_dir, name)
    except ValueError:
        raise bad_request(
            f"Model '{name}' points outside the models root; name a directory inside it.", param
        ) from None
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise bad_request(f"Model directory '{name}' has no config.json; it is not a Hugging Face model.", param)
        return path
    if not hub_offline and name.count("/") == 1 and ".." not in name:
        return name  # a hub id, loaded by the worker
    raise bad_request(
        f"No model directory '{name}' under the models root. Models available: "
        f"{', '.join(list_models(models_dir)) or 'none'}.",
        param,
        "model_not_found",
    )


def list_models(models_dir: Path) -> list[str]:
    if not models_dir.is_dir():
        return []
    found = []
    for config in sorted(models_dir.glob("*/config.json")) + sorted(models_dir.glob("*/*/config.json")):
        found.append(str(config.parent.relative_to(models_dir)))
    return found[:20]
