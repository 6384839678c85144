"""Prompt datasets as users upload them: JSONL, validated line by line while it streams to disk.

Every mistake is a 400 that names the line and says what to change (another encoding, a JSON array,
pretty-printed JSON, a line without a prompt...); a file is written under a temporary name and
renamed into place only when every line is valid. The worker reads a stored file with
``worker.engine.data.load_items``: whatever passes here reads the same there.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from service.core import strictjson
from service.core.errors import Invalid, TooLarge, bad_request
from service.core.identity import writer_tag

FORMATS = ("prompt", "chat", "preference")
"""What a line can be: a ``prompt`` (``prompt``, or ``messages`` ending in a user turn) for
reinforcement, a ``chat`` example (``messages`` with assistant turns to learn) for supervised, a
``preference`` pair (``input``, ``preferred_output``, ``non_preferred_output``) for DPO."""

METHOD_FORMAT = {"reinforcement": "prompt", "supervised": "chat", "dpo": "preference"}
"""The line format each method family trains on."""

PURPOSES = ("fine-tune", "evals", "user_data")
"""What a file is uploaded for: training lines (``check_line``), or an eval's items
(``check_eval_line``: ``{"item": {...}, "sample": {...}}`` as OpenAI's Evals take them). ``user_data``
holds eval items too: the ``openai`` SDK's file type lacks ``evals``, so a client validating answers
strictly uploads its items under ``user_data``."""
EVAL_PURPOSES = ("evals", "user_data")


class UploadSummary:
    def __init__(self) -> None:
        self.lines = 0
        self.bytes = 0
        self.key_counts: dict[str, int] = {}
        self.first_missing: dict[str, int] = {}
        self.formats: dict[str, int] = {}
        self.first_not: dict[str, int] = {}

    def add(self, lineno: int, keys: set[str], kind: str = "prompt") -> None:
        for key in keys:
            if key not in self.key_counts:
                self.key_counts[key] = 0
                if lineno > 1:  # earlier lines lacked it
                    self.first_missing.setdefault(key, 1)
            self.key_counts[key] += 1
        for key in self.key_counts:
            if key not in keys:
                self.first_missing.setdefault(key, lineno)
        self.formats[kind] = self.formats.get(kind, 0) + 1
        for other in FORMATS:
            if other != kind:
                self.first_not.setdefault(other, lineno)

    def as_dict(self) -> dict[str, Any]:
        return {
            "keys": self.key_counts,
            "first_missing": self.first_missing,
            "formats": self.formats,
            "first_not": self.first_not,
        }


def first_line_not(keys_summary: dict[str, Any], method: str) -> tuple[int, str] | None:
    """The first line of a stored file that is not of the format ``method`` trains on, and the
    format it needs; None when every line fits. (Files stored before formats were recorded held
    prompts only.)"""
    wanted = METHOD_FORMAT[method]
    first_not = keys_summary.get("first_not", {"chat": 1, "preference": 1})
    line = first_not.get(wanted)
    return (int(line), wanted) if line is not None else None


def _invalid(message: str) -> Invalid:
    return bad_request(message, "file", "invalid_file")


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
_ARRAY_HINT = (
    " The file looks like one JSON array; JSONL is one object a line, with no enclosing [ ] and no commas "
    "between the lines."
)
_OBJECT_HINT = ' Each line must be one JSON object, such as {"prompt": "..."}.'
ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_message(m: Any, lineno: int, where: str) -> None:
    """One chat message of OpenAI's format: a role, text content (an assistant's may be null beside
    ``tool_calls``), an assistant's optional ``weight`` of 0 or 1."""
    if isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), list):
        # OpenAI's multimodal shape [{"type": "text", "text": ...}]: the chat templates and the
        # reward models of the worker take a string; joining the parts would guess a separator.
        raise _invalid(
            f"Line {lineno}: {where}.content is a list of content parts; only text content "
            'given as one string is supported: write "content": "..." (join the text parts yourself).'
        )
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise _invalid(f"Line {lineno}: {where} must be an object with string 'role' and 'content'.")
    role = m["role"]
    if role not in ROLES:
        raise _invalid(f"Line {lineno}: {where}.role is '{role}'; a role is one of {', '.join(ROLES)}.")
    content = m.get("content")
    tool_calls = m.get("tool_calls")
    if tool_calls is not None and (role != "assistant" or not isinstance(tool_calls, list)):
        raise _invalid(f"Line {lineno}: {where}.tool_calls must be a list, on an assistant message.")
    if not isinstance(content, str) and not (role == "assistant" and tool_calls and content is None):
        raise _invalid(f"Line {lineno}: {where} must be an object with string 'role' and 'content'.")
    if "weight" in m and (role != "assistant" or m["weight"] not in (0, 1) or isinstance(m["weight"], bool)):
        raise _invalid(f"Line {lineno}: {where}.weight must be 0 or 1, on an assistant message.")


def _check_messages(msgs: Any, lineno: int, where: str) -> None:
    if not isinstance(msgs, list) or not msgs:
        raise _invalid(f"Line {lineno}: '{where}' must be a non-empty list.")
    for i, m in enumerate(msgs):
        _check_message(m, lineno, f"{where}[{i}]")


def _conversation_kind(msgs: list[dict[str, Any]], lineno: int) -> str:
    """``prompt`` (the last turn is the user's: the model answers it) or ``chat`` (assistant turns
    to learn, weight 1 on at least one)."""
    last = msgs[-1]["role"]
    if last == "user":
        return "prompt"
    if last == "assistant":
        if not any(m["role"] == "assistant" and m.get("weight", 1) == 1 for m in msgs):
            raise _invalid(f"Line {lineno}: every assistant message has weight 0; nothing is left to learn.")
        return "chat"
    raise _invalid(
        f"Line {lineno}: the last message must be a user turn (a prompt, for reinforcement) or an assistant "
        f"turn (an example, for supervised); got role '{last}'."
    )


def _check_preference(obj: dict[str, Any], lineno: int) -> None:
    """OpenAI's DPO line: ``input.messages`` (ending in a user turn), and one preferred and one
    non-preferred assistant output."""
    missing = [k for k in ("input", "preferred_output", "non_preferred_output") if k not in obj]
    if missing:
        raise _invalid(
            f"Line {lineno}: a preference line needs 'input', 'preferred_output' and 'non_preferred_output'; "
            f"'{missing[0]}' is missing."
        )
    if not isinstance(obj["input"], dict) or "messages" not in obj["input"]:
        raise _invalid(f"Line {lineno}: 'input' must be an object with 'messages'.")
    _check_messages(obj["input"]["messages"], lineno, "input.messages")
    if obj["input"]["messages"][-1]["role"] != "user":
        raise _invalid(f"Line {lineno}: the last of input.messages must be a user turn (the outputs answer it).")
    for key in ("preferred_output", "non_preferred_output"):
        _check_messages(obj[key], lineno, key)
        if any(m["role"] != "assistant" for m in obj[key]):
            raise _invalid(f"Line {lineno}: {key} must hold assistant messages only.")


def check_line(obj: Any, lineno: int) -> tuple[set[str], str]:
    """Validate one parsed JSONL line; returns the keys graders may use as ``item.<key>`` and the
    line's format (``FORMATS``)."""
    if not isinstance(obj, dict):
        kind = "null" if obj is None else _JSON_TYPES.get(type(obj), type(obj).__name__)
        hint = _ARRAY_HINT if lineno == 1 and isinstance(obj, list) else _OBJECT_HINT
        raise _invalid(f"Line {lineno} is a JSON {kind}, not an object.{hint}")
    if any(k in obj for k in ("preferred_output", "non_preferred_output")) or (
        "input" in obj and "messages" not in obj and "prompt" not in obj
    ):
        _check_preference(obj, lineno)
        return set(), "preference"
    if "messages" in obj:
        _check_messages(obj["messages"], lineno, "messages")
        if "tools" in obj and not isinstance(obj["tools"], list):
            raise _invalid(f"Line {lineno}: 'tools' must be a list of tool definitions.")
        kind = _conversation_kind(obj["messages"], lineno)
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise _invalid(f"Line {lineno}: 'prompt' must be a non-empty string.")
        kind = "prompt"
    else:
        raise _invalid(
            f"Line {lineno} has neither 'messages' nor 'prompt' (nor a preference pair's 'input'); each line "
            "needs one of them."
        )
    return set(obj) - {"messages", "prompt"}, kind


def check_eval_line(obj: Any, lineno: int) -> tuple[set[str], str]:
    """One line of an ``evals`` file: ``{"item": {...}}``, and ``sample`` (an answer already made:
    ``{"output_text": ...}``) where the runs read answers from the file. Returns the item's keys."""
    if not isinstance(obj, dict) or not isinstance(obj.get("item"), dict):
        raise _invalid(
            f'Line {lineno} is not an eval item: each line is {{"item": {{...}}}} (and "sample": {{"output_text": '
            "...}} where the file holds the answers to grade)."
        )
    extra = sorted(set(obj) - {"item", "sample"})
    if extra:
        raise _invalid(f"Line {lineno} has {extra[0]!r}; an eval line holds 'item' and, optionally, 'sample'.")
    if "sample" in obj and not isinstance(obj["sample"], dict):
        raise _invalid(f'Line {lineno}: \'sample\' must be an object, such as {{"output_text": "..."}}.')
    return set(obj["item"]), "eval_item"


LINE_CHECKS = {"fine-tune": check_line, "evals": check_eval_line, "user_data": check_eval_line}
"""Each purpose's line check."""


# What a line may be: UTF-8 JSON (service.core.strictjson's), an object, no deeper than MAX_DEPTH.
MAX_DEPTH = 100  # levels of nested arrays and objects in one line; a dataset line needs a few
UTF8_BOM = b"\xef\xbb\xbf"
_SIGNATURES = (  # the first bytes of files that are not UTF-8 text, and what to tell
    (b"\xff\xfe\x00\x00", "The file is UTF-32 encoded (it starts with a UTF-32 byte-order mark)"),
    (b"\x00\x00\xfe\xff", "The file is UTF-32 encoded (it starts with a UTF-32 byte-order mark)"),
    (b"\xff\xfe", "The file is UTF-16 encoded (it starts with a UTF-16 byte-order mark)"),
    (b"\xfe\xff", "The file is UTF-16 encoded (it starts with a UTF-16 byte-order mark)"),
    (b"\x1f\x8b", "The file is gzip-compressed"),
    (b"PK\x03\x04", "The file is a zip archive"),
    (b"BZh", "The file is bzip2-compressed"),
    (b"\xfd7zXZ\x00", "The file is xz-compressed"),
    (b"\x28\xb5\x2f\xfd", "The file is zstd-compressed"),
)


def sniff(head: bytes) -> None:
    """Refuse a file whose first bytes say it is not UTF-8 text: another encoding, or compressed."""
    for signature, what in _SIGNATURES:
        if head.startswith(signature):
            if "encoded" in what:
                raise _invalid(f"{what}; save it as UTF-8 and upload it again.")
            raise _invalid(f"{what}; upload the uncompressed .jsonl file.")
    if b"\x00" in head[:4]:  # JSON text never holds a NUL byte; UTF-16 has one beside every ASCII character
        raise _invalid(
            "The file looks UTF-16 encoded (line 1 has NUL bytes between its characters); save it as UTF-8 "
            "and upload it again."
        )


def _json_error_hint(text: str, exc: json.JSONDecodeError, lineno: int) -> str:
    stripped = text.strip()
    if lineno == 1 and stripped.startswith("["):
        return _ARRAY_HINT
    if "control character" in exc.msg:
        return " A tab, line break or other control character inside a string must be escaped (\\t, \\n, \\u0001)."
    if exc.pos >= len(text.rstrip()):
        return (
            " The line ends before its JSON value does: JSONL needs each object whole on one line "
            "(pretty-printed JSON is not JSONL)."
        )
    if not stripped.startswith(("{", "[")):
        looks = " It looks like CSV, not JSON." if lineno == 1 and "," in stripped else ""
        return looks + _OBJECT_HINT
    return ""


def parse_line(raw: bytes, lineno: int) -> Any:
    """One non-blank line's bytes as JSON, or a 400 naming the line and saying what to change.

    The worker reads the stored file with ``worker.engine.data.load_items``; whatever passes here must
    read the same there.
    """
    if b"\x00" in raw:
        raise _invalid(
            f"Line {lineno} contains NUL bytes (0x00), which JSON text never has; save the file as UTF-8 text "
            "(a UTF-16 file has NUL bytes between its characters)."
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(
            f"Line {lineno} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line); "
            "save the file as UTF-8."
        ) from None
    if text.startswith("\ufeff"):
        raise _invalid(
            f"Line {lineno} starts with a byte-order mark (U+FEFF), which only the start of the file may have "
            "(were files joined together?); remove it."
        )
    try:
        obj = strictjson.loads(text, max_depth=MAX_DEPTH)
    except strictjson.InvalidJSON as exc:  # NaN, 1e999, a lone surrogate, a NUL, too deep
        raise _invalid(f"Line {lineno}: {exc.problem}{exc.where()}.") from None
    except json.JSONDecodeError as exc:
        raise _invalid(
            f"Line {lineno} is not valid JSON: {exc.msg.removesuffix(' at')} at column {exc.colno}."
            f"{_json_error_hint(text, exc, lineno)}"
        ) from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits (Python's int limit)
        raise _invalid(f"Line {lineno} has a value JSON readers refuse: {exc}; remove it.") from None
    return obj


def _read_lines(
    source: IO[bytes], out: Any, summary: UploadSummary, *, max_bytes: int, max_line_bytes: int, chunk: int
) -> Iterator[tuple[int, bytes]]:
    """Yield ``(line number, raw line)`` from ``source``, copying every byte to ``out``.

    The file's first bytes are sniffed (another encoding, a compressed file: a 400 that says so); a
    UTF-8 byte-order mark at its start is kept in the copy but left out of line 1, as the worker's
    reader (``utf-8-sig``) leaves it out.
    """
    pending = b""
    lineno = 0
    head: bytes | None = b""  # the file's first bytes, until sniffed
    while block := source.read(chunk):
        summary.bytes += len(block)
        if summary.bytes > max_bytes:
            raise TooLarge(
                f"The file is larger than the limit of {max_bytes} bytes.", param="file", code="file_too_large"
            )
        out.write(block)
        if head is not None:
            head += block
            if len(head) < len(UTF8_BOM) + 1:
                continue  # too few bytes to tell yet: the next block joins them
            sniff(head)
            block, head = head.removeprefix(UTF8_BOM), None
        *complete, pending = (pending + block).split(b"\n")
        for raw in complete:
            lineno += 1
            yield lineno, raw
        if len(pending) > max_line_bytes:
            raise _invalid(_too_long(lineno + 1, max_line_bytes))
    if head:  # a file shorter than the sniff
        sniff(head)
        pending = head.removeprefix(UTF8_BOM)
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            lineno += 1
            yield lineno, raw
    if pending:
        yield lineno + 1, pending


def _too_long(lineno: int, limit: int) -> str:
    size = f" ({limit / 2**20:g} MiB)" if limit >= 2**20 else ""
    return f"Line {lineno} is longer than the limit of {limit} bytes{size} a line; shorten it."


def store_jsonl(
    source: IO[bytes],
    *,
    dest: Path,
    max_bytes: int,
    max_line_bytes: int,
    chunk: int = 1 << 20,
    purpose: str = "fine-tune",
) -> UploadSummary:
    """Copy ``source`` to ``dest`` while validating it line by line.

    Written under a temporary name in the destination folder and renamed into place only when every
    line is valid: on any error nothing is left behind.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".upload-{writer_tag()}-", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            summary = copy_jsonl(
                source, out, max_bytes=max_bytes, max_line_bytes=max_line_bytes, chunk=chunk, purpose=purpose
            )
        tmp.replace(dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return summary


def copy_jsonl(
    source: IO[bytes],
    out: Any,
    *,
    max_bytes: int,
    max_line_bytes: int,
    chunk: int = 1 << 20,
    purpose: str = "fine-tune",
) -> UploadSummary:
    """Copy ``source`` to ``out`` (anything with ``write(bytes)``: a file, an object store's
    multipart upload) a block at a time while validating it line by line; a 400 or 413 at the first
    fault, with what was written so far left to the caller to discard."""
    summary = UploadSummary()
    check = LINE_CHECKS[purpose]
    blank_at: int | None = None
    for lineno, raw in _read_lines(
        source, out, summary, max_bytes=max_bytes, max_line_bytes=max_line_bytes, chunk=chunk
    ):
        if len(raw) > max_line_bytes:
            raise _invalid(_too_long(lineno, max_line_bytes))
        if not raw.strip():
            blank_at = blank_at or lineno
            continue
        if blank_at is not None:
            raise _invalid(f"Line {blank_at} is empty; remove blank lines.")
        summary.add(summary.lines + 1, *check(parse_line(raw, lineno), lineno))
        summary.lines += 1
    if summary.lines == 0:
        raise _invalid("The file is empty: it needs at least one JSONL line.")
    return summary
