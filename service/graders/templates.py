"""Templates: ``{{ item.key }}``, ``{{ sample.output_text }}`` and ``{{ sample.output_json.key }}``.

A template is checked when its grader is parsed (``validate``: a typo fails job creation, not
training) and filled per sample when it is graded (``render``). A key that one line or one
completion lacks is a ``TemplateKeyError`` for that sample alone, which grading turns into NaN.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from service.graders.types import GraderError, Sample, describe

__all__ = ["TemplateKeyError", "render", "render_batch", "template_item_keys", "validate"]


class TemplateKeyError(KeyError):
    """A template referenced a key that this sample's item or completion lacks.

    Raised at grading time, not parse time: the key may exist on most lines and be missing on one.
    Grading turns it into a NaN reward for that sample. Subclasses ``KeyError`` because that is what
    it is; ``__str__`` is overridden since ``KeyError`` would quote the whole message.
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.message = message
        self.path = path

    def __str__(self) -> str:
        return self.message


_TEMPLATE_OPEN = "{{"
_TEMPLATE_CLOSE = "}}"
_SAMPLE_FIELDS = ("output_text", "output_json", "output_tools", "messages", "rollout_id")


def _template_refs(template: str) -> list[tuple[int, int, str]]:
    """``(start, end, path)`` for each ``{{ path }}`` in ``template``, whitespace stripped.

    Raises ``ValueError`` with a message saying what to change for an unclosed ``{{`` or an empty
    ``{{ }}``: either would otherwise be compared literally and silently earn a reward of zero on
    every sample.
    """
    refs: list[tuple[int, int, str]] = []
    pos = 0
    while True:
        start = template.find(_TEMPLATE_OPEN, pos)
        if start < 0:
            return refs
        end = template.find(_TEMPLATE_CLOSE, start + len(_TEMPLATE_OPEN))
        if end < 0:
            raise ValueError(f"unclosed '{{{{' at position {start}; close it with '}}}}' as in '{{{{ item.answer }}}}'")
        path = template[start + len(_TEMPLATE_OPEN) : end].strip()
        if not path:
            raise ValueError(
                f"empty '{{{{ }}}}' at position {start}; write a reference such as "
                "'{{ item.answer }}' or '{{ sample.output_text }}'"
            )
        refs.append((start, end + len(_TEMPLATE_CLOSE), path))
        pos = end + len(_TEMPLATE_CLOSE)


def _check_path(path: str) -> list[str]:
    """Split a template reference into segments and check its root; ``ValueError`` if malformed."""
    parts = path.split(".")
    if any(not p or any(ch.isspace() for ch in p) for p in parts):
        raise ValueError(
            f"'{{{{ {path} }}}}' is not a valid reference; use dotted keys without spaces, "
            "such as 'item.answer' or 'sample.output_json.score'"
        )
    root = parts[0]
    if root == "item":
        return parts
    if root == "sample":
        if len(parts) < 2 or parts[1] not in _SAMPLE_FIELDS:
            raise ValueError(
                f"'{{{{ {path} }}}}' is not a sample field; use sample.output_text, "
                "sample.output_json (optionally followed by .key), or for a rollout that called tools "
                "sample.output_tools, sample.messages or sample.rollout_id"
            )
        if parts[1] == "output_text" and len(parts) > 2:
            raise ValueError(
                f"'{{{{ {path} }}}}': sample.output_text is a string and has no keys; "
                "use sample.output_json.KEY to read a field of a JSON completion"
            )
        return parts
    raise ValueError(
        f"'{{{{ {path} }}}}' must start with 'item.' (a field of the training-file line) or 'sample.' (the completion)"
    )


def validate(template: str, *, param: str) -> None:
    """Parse-time check of a template, so a typo fails job creation instead of training."""
    try:
        for _, _, path in _template_refs(template):
            _check_path(path)
    except ValueError as exc:
        raise GraderError(str(exc), param=param) from None


def template_namespaces(template: str) -> set[str]:
    """The namespaces ``template`` reads (``{"item"}``, ``{"item", "sample"}``); malformed references
    are skipped here, ``validate`` reports them."""
    try:
        return {path.split(".")[0] for _, _, path in _template_refs(template)}
    except ValueError:
        return set()


def template_item_keys(template: str) -> set[str]:
    """The top-level ``item`` keys that ``template`` references (``{{ item.a.b }}`` gives ``a``).

    Used at job creation to check every training-file line has them. Malformed references are
    skipped here; ``parse_grader`` reports them.
    """
    keys: set[str] = set()
    try:
        refs = _template_refs(template)
    except ValueError:
        return keys
    for _, _, path in refs:
        parts = path.split(".")
        if len(parts) >= 2 and parts[0] == "item" and parts[1]:
            keys.add(parts[1])
    return keys


def _lookup(value: object, parts: list[str], *, path: str) -> object:
    """Walk ``parts`` into ``value``; integer segments index arrays (``item.choices.0``)."""
    walked = parts[0]
    for part in parts[1:]:
        if isinstance(value, Mapping):
            if part not in value:
                raise TemplateKeyError(
                    f"template references {{{{ {path} }}}}, but {walked} has no key '{part}'",
                    path=path,
                )
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.isascii() and part.isdigit():
            index = int(part)
            if index >= len(value):
                raise TemplateKeyError(
                    f"template references {{{{ {path} }}}}, but {walked} has only {len(value)} elements",
                    path=path,
                )
            value = value[index]
        else:
            raise TemplateKeyError(
                f"template references {{{{ {path} }}}}, but {walked} is {describe(value)}, which has no key '{part}'",
                path=path,
            )
        walked = f"{walked}.{part}"
    return value


def _resolve(path: str, *, sample: Sample, item: Mapping[str, object]) -> object:
    try:
        parts = _check_path(path)
    except ValueError as exc:
        # Only reachable for templates that bypassed parse_grader; still a per-sample failure.
        raise TemplateKeyError(str(exc), path=path) from None
    if parts[0] == "item":
        return _lookup(item, parts, path=path)
    if parts[1] == "output_text":
        return sample.output_text
    if parts[1] in ("output_tools", "messages", "rollout_id"):
        value = {"output_tools": sample.output_tools, "messages": sample.messages, "rollout_id": sample.rollout_id}[
            parts[1]
        ]
        if value is None:
            raise TemplateKeyError(f"template references {{{{ {path} }}}}, but the rollout called no tools", path=path)
        return _lookup(value, [f"sample.{parts[1]}", *parts[2:]], path=path)
    parsed = sample.output_json
    if parsed is None:
        raise TemplateKeyError(
            f"template references {{{{ {path} }}}}, but the completion is not valid JSON",
            path=path,
        )
    return _lookup(parsed, ["sample.output_json", *parts[2:]], path=path)


def _to_text(value: object) -> str:
    """Strings as-is (no quotes), anything else as JSON, so ``{{ item.n }}`` of 42 gives ``42``."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def render(template: str, *, sample: Sample, item: Mapping[str, object]) -> str:
    """Fill ``{{ item.key }}``, ``{{ sample.output_text }}`` and ``{{ sample.output_json.key }}``.

    Text outside the braces is kept literally. Raises ``TemplateKeyError`` when a referenced key is
    missing (or the completion is not JSON for ``output_json``).
    """
    try:
        refs = _template_refs(template)
    except ValueError as exc:
        raise TemplateKeyError(str(exc), path="") from None
    if not refs:
        return template
    pieces: list[str] = []
    pos = 0
    for start, end, path in refs:
        pieces.append(template[pos:start])
        pieces.append(_to_text(_resolve(path, sample=sample, item=item)))
        pos = end
    pieces.append(template[pos:])
    return "".join(pieces)


def render_batch(template: str, samples: Sequence[Sample], items: Sequence[Mapping[str, object]]) -> list[str | None]:
    """``render`` for each sample of a batch; None where the template misses a key."""
    texts: list[str | None] = []
    for sample, item in zip(samples, items, strict=True):
        try:
            texts.append(render(template, sample=sample, item=item))
        except TemplateKeyError:
            texts.append(None)
    return texts
