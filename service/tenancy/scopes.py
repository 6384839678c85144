"""The scopes a key may hold, what each allows, and reading a list of them from a user.

A project's key holds some of ``PROJECT_SCOPES``; ``keys`` makes it its project's admin (it manages
the project's keys and reads its audit log). A ``…:write`` scope includes its ``…:read``. An
operator's key (``api_keys.operator``) holds every project scope of its own project and, besides,
``operator``: the routes over every project (the fleet, projects, their quotas and usage). A key made
without scopes holds them all, as every key did before scopes existed."""

from __future__ import annotations

from collections.abc import Iterable

from service.core.errors import bad_request

PROJECT_SCOPES: dict[str, str] = {
    "files:read": "list, read and download the project's files",
    "files:write": "upload and delete files (and read them)",
    "jobs:read": "read jobs, their events, metrics, samples and checkpoints; evals and their runs; Tinker runs",
    "jobs:write": "create, cancel, pause and resume jobs; run evals and graders; train over the Tinker protocol",
    "models:read": "list and read models",
    "models:write": "delete fine-tuned models (and read them)",
    "inference": "chat and text completions; Tinker sampling",
    "webhooks": "create, change, test and delete webhook endpoints",
    "keys": "the project's admin: create, list and revoke its keys; read its audit log",
}
OPERATOR = "operator"
"""Not a project's scope: an operator's key holds it (``rloo keys create --operator``)."""
ALL = frozenset(PROJECT_SCOPES)
ALL_WORD = "all"
"""What a user writes for every project scope."""


def parse(values: Iterable[str] | None, *, param: str = "scopes") -> frozenset[str]:
    """The scopes a user named (``None`` or ``["all"]``: all of them), each ``…:write`` with its
    ``…:read``; an unknown or empty one is a 400 naming it and listing the known ones."""
    if values is None:
        return ALL
    names = [v.strip() if isinstance(v, str) else v for v in values]
    if not names:
        raise bad_request(f"Name at least one scope ({', '.join(PROJECT_SCOPES)}, or '{ALL_WORD}').", param)
    out: set[str] = set()
    for i, name in enumerate(names):
        if name == ALL_WORD:
            out |= ALL
        elif name == OPERATOR:
            raise bad_request(
                "'operator' is not a project scope: an operator's key is made by the operator "
                "(`rloo keys create --operator`).",
                f"{param}[{i}]",
            )
        elif name not in PROJECT_SCOPES:
            raise bad_request(
                f"Unknown scope {name!r}: scopes are {', '.join(PROJECT_SCOPES)} (or '{ALL_WORD}').", f"{param}[{i}]"
            )
        else:
            out.add(name)
            if name.endswith(":write"):
                out.add(name.replace(":write", ":read"))
    return frozenset(out)


def ordered(scopes: Iterable[str]) -> list[str]:
    """``scopes`` in the table's order (``operator`` last): how they are stored and shown."""
    held = set(scopes)
    return [s for s in PROJECT_SCOPES if s in held] + ([OPERATOR] if OPERATOR in held else [])
