"""A run's items: read from its file (or the request's inline content), each checked against the
eval's ``item_schema``, and each turned into the messages its model answers (``input_messages``).

The API checks the lines it can check at once (inline content, and a file's first ``CHECK_AT_CREATION``
lines): a 400 naming the line, nothing stored. The worker checks every line again before it answers
any (``check``): a file's later line that does not fit fails the run, naming the line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.core import jsonschemas
from service.core.errors import bad_request
from service.graders import Sample, templates

CHECK_AT_CREATION = 10_000
"""Lines of a run's file the API checks before it answers (the worker checks all)."""


@dataclass(frozen=True)
class Item:
    """One line: its item, and the answer it brings (a jsonl run's ``sample``), if any."""

    index: int  # 0-based: OpenAI's datasource_item_id
    item: dict[str, Any]
    sample: dict[str, Any] | None = None


def file_lines(path: Path, limit: int | None = None) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed line)`` of a stored ``evals`` file (its upload checked each one)."""
    with path.open(encoding="utf-8-sig") as lines:
        number = 0
        for raw in lines:
            if not raw.strip():
                continue
            number += 1
            if limit is not None and number > limit:
                return
            yield number, json.loads(raw)


def check(
    lines: Iterable[tuple[int, Any]], schema: Mapping[str, Any], *, where: str, param: str, needs_sample: bool
) -> list[Item]:
    """The items of ``lines`` (each ``{"item": {...}, "sample"?: {...}}``), each fitting ``schema``
    and, where the run has no model to answer, carrying a ``sample`` with ``output_text``; a 400
    naming the first line that does not. ``where`` and ``param`` are formats of the line's number
    ``n`` ("line {n} of file file-…", "data_source.source.content.{n}")."""
    validator = jsonschemas.validator(schema)
    out: list[Item] = []
    for number, line in lines:
        at, param_at = where.format(n=number), param.format(n=number)
        at = at[:1].upper() + at[1:]
        if not isinstance(line, Mapping) or not isinstance(line.get("item"), Mapping):
            raise bad_request(f"{at} is not an eval item: give {{'item': {{...}}}}.", param_at)
        error = _first_error(validator, line["item"])
        if error is not None:
            raise bad_request(f"{at} does not fit the eval's item_schema: {error}.", param_at, "invalid_item")
        sample = line.get("sample")
        if needs_sample and not (isinstance(sample, Mapping) and isinstance(sample.get("output_text"), str)):
            raise bad_request(
                f"{at} has no sample.output_text: a jsonl run grades the answers its lines hold (or use "
                "a 'completions' data_source, whose model answers).",
                param_at,
                "invalid_item",
            )
        out.append(Item(len(out), dict(line["item"]), dict(sample) if isinstance(sample, Mapping) else None))
    return out


def _first_error(validator: Any, item: Any) -> str | None:
    import jsonschema
    from referencing.exceptions import Unresolvable

    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(item))
    except (RecursionError, LookupError, Unresolvable) as exc:
        return f"the item_schema could not be applied to it ({type(exc).__name__})"
    if error is None:
        return None
    where = ".".join(str(p) for p in error.absolute_path)
    return f"item.{where}: {error.message}" if where else error.message


def messages(input_messages: Mapping[str, Any], item: Mapping[str, Any]) -> list[dict[str, str]]:
    """The chat messages a model answers for ``item``: the template rendered over it, or the item's
    own messages (``item_reference``). Raises ``ValueError`` saying what is wrong with the item."""
    if input_messages["type"] == "item_reference":
        key = input_messages["item_reference"].split(".", 1)[1]
        found: Any = item
        for part in key.split("."):
            if not isinstance(found, Mapping) or part not in found:
                raise ValueError(f"the item has no {input_messages['item_reference']}")
            found = found[part]
        if isinstance(found, str):
            return [{"role": "user", "content": found}]
        if not isinstance(found, list) or not all(isinstance(m, Mapping) and "role" in m for m in found):
            raise ValueError(f"{input_messages['item_reference']} is not a list of messages")
        return [{"role": str(m["role"]), "content": _text(m.get("content"))} for m in found]
    blank = Sample(output_text="")
    try:
        return [
            {"role": m["role"], "content": templates.render(m["content"], sample=blank, item=item)}
            for m in input_messages["template"]
        ]
    except templates.TemplateKeyError as exc:
        raise ValueError(f"the input messages read a key the item lacks: {exc}") from None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else json.dumps(content)
