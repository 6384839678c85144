"""A checkpoint as one full model (``GET …/checkpoints/{id}/content?merged=true``): every LoRA adapter
of its fine-tuned chain merged into the weights before it, saved in safetensors with its tokenizer, so
that ``from_pretrained`` and ``vllm serve`` load the directory as it is. The API loads no weights and
waits for none: an inference worker merges (``worker.serving.between_batches.export``), once a checkpoint, into
``<artifacts>/exports/<job id>/step-<N>`` (with an object store, that key: the worker publishes it
there). Until it is there, a download is answered at once with 503 ``export_in_progress`` and
``Retry-After``; the merge was asked for once (a marker in Redis, ``export:<key>``, while it is queued
or a worker holds it), at most ``MERGES_PER_PROJECT`` at once a project, and a failed merge is the
next download's answer, after which it may be asked again. The worker records the export's bytes on
its checkpoint's row (``export_bytes``, counted in the project's stored bytes) until it is removed.

Where exports live, and their removal with what they were made from, is ``service.registry.export_dirs``."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from service.core.errors import Gone, LimitReached, Unavailable, no_inference_worker, queue_unreachable
from service.core.settings import Settings
from service.core.tables import Checkpoint
from service.infra import inference_bus
from service.infra.artifacts import S3Store
from service.registry import finetuned
from service.registry.export_dirs import export_key
from service.tenancy import quotas


def merged(
    session: Session, settings: Settings, *, project_seq: int, project_id: str, checkpoint: Checkpoint
) -> Path | None:
    """The merged model directory of ``checkpoint``; None when the checkpoint is a full model whose
    chain holds no adapter (its own directory is the merged model). Not made yet: its merge asked
    for, and 503 ``export_in_progress`` (or the merge's error)."""
    name = checkpoint.fine_tuned_model_checkpoint or ""
    source = finetuned.find(session=session, project_seq=project_seq, name=name, include_deleted=True)
    if source is None:
        raise _gone(name)
    chain = [settings.artifacts_dir / path for path in source.chain]
    if not any((path / "adapter_config.json").is_file() for path in chain):
        return None
    key = export_key(Path(checkpoint.path).parent.name, checkpoint.step_number)
    target = settings.artifacts_dir / key
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    servable = {"base": str(settings.models_dir / source.base_model), "chain": [str(p) for p in chain]}
    envelope = {"kind": "export", "servable": servable, "target": str(target), "checkpoint": checkpoint.id}
    _ask_once(
        settings, key, envelope, project_id, room=lambda: quotas.check_storage(session, project_seq, 1, lock=False)
    )
    raise AssertionError("unreachable")  # pragma: no cover


def merged_in_store(
    session: Session, settings: Settings, store: S3Store, *, project_seq: int, project_id: str, checkpoint: Checkpoint
) -> str | None:
    """``merged`` with an object store: the key of the merged model (the worker fetches the chain and
    publishes the export as a checkpoint, marker last); None when the chain holds no adapter."""
    name = checkpoint.fine_tuned_model_checkpoint or ""
    source = finetuned.find(session=session, project_seq=project_seq, name=name, include_deleted=True)
    if source is None:
        raise _gone(name)
    manifests = [store.manifest(path) for path in source.chain]
    if any(m is None for m in manifests):
        raise _gone(name)
    if not any("adapter_config.json" in (m or {}) for m in manifests):
        return None
    key = export_key(Path(checkpoint.path).parent.name, checkpoint.step_number)
    if store.manifest(key) is not None:
        return key
    servable = {"base": str(settings.models_dir / source.base_model), "chain": list(source.chain)}
    envelope = {"kind": "export", "servable": servable, "target": key, "checkpoint": checkpoint.id}  # relative
    _ask_once(
        settings, key, envelope, project_id, room=lambda: quotas.check_storage(session, project_seq, 1, lock=False)
    )
    raise AssertionError("unreachable")  # pragma: no cover


def _gone(name: str) -> Gone:
    return Gone(f"The checkpoints that {name} was trained from are gone.", code="checkpoint_gone")


MERGES_PER_PROJECT = 2
"""Merges a project may have asked for and not yet had (429 past it): each may be a 7B model's
minutes on an inference worker's background thread and ~28 GB of disk."""
MERGE_SECONDS = 3600.0
"""How long an ask counts against its project's merges when nobody comes back for its answer."""


def _ask_once(
    settings: Settings, key: str, envelope: dict[str, Any], project_id: str, *, room: Callable[[], None]
) -> None:
    """Ask an inference worker for the export ``key`` (in the project's lane) unless it was asked
    already; raise what the download answers now: the merge's error, or 503 ``export_in_progress``.
    ``room()`` raises where the project may store no more (its quota), checked only before a new ask:
    a merge under way or failed is still answered as such."""
    import redis

    ns = inference_bus.namespace(inference_bus.serve_queue())
    marker, asks = f"{ns}:export:{key}", f"{ns}:exports:{project_id}"
    conn = redis.Redis.from_url(settings.redis_client_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        asked = conn.get(marker)
        if asked is not None:
            _answer_of(conn, ns, marker, asks, key, json.loads(asked))
        if not inference_bus.live_workers(conn, ns):
            raise no_inference_worker("Merging an adapter needs an inference worker")
        room()
        conn.zremrangebyscore(asks, "-inf", time.time())
        if conn.zcard(asks) >= MERGES_PER_PROJECT and conn.zscore(asks, key) is None:
            raise LimitReached(
                f"This project has {MERGES_PER_PROJECT} merged models being made; download those first (each is "
                "made once), then ask for this one.",
                retry_after=30,
            )
        rid = f"export-{secrets.token_hex(12)}"
        deadline = time.time() + settings.inference_timeout_seconds  # to be taken by a worker
        if conn.set(marker, json.dumps({"id": rid, "deadline": deadline}), nx=True, ex=86400):
            conn.zadd(asks, {key: time.time() + MERGE_SECONDS})
            conn.expire(asks, int(MERGE_SECONDS) + 60)
            try:
                inference_bus.submit_sync(
                    conn, ns, {"id": rid, "project": project_id, "deadline": deadline, **envelope}
                )
            except redis.RedisError:
                conn.delete(marker)  # not asked after all: the next download asks
                conn.zrem(asks, key)
                raise
    except redis.RedisError as exc:
        raise queue_unreachable(exc) from None
    finally:
        conn.close()
    raise _in_progress()


def _answer_of(conn: Any, ns: str, marker: str, asks: str, key: str, asked: dict[str, Any]) -> None:
    """The asked merge's state. Its last word: an error raised, or done; either way the ask is let go
    (so the next download asks again, should the model be gone). Taken by a worker (its lease), or
    still queued before its deadline: under way. Never taken by then: let go, to be asked again."""
    last = conn.lindex(f"{ns}:reply:{asked['id']}", -1)
    if last is None and (conn.exists(f"{ns}:lease:{asked['id']}") or time.time() < float(asked["deadline"])):
        raise _in_progress()
    conn.delete(marker)
    conn.zrem(asks, key)
    answer = json.loads(last) if last is not None else {}
    if answer.get("t") == "error":
        raise inference_bus.error_of(answer)  # 503 when the worker holding it died (ask again), else it raised


def _in_progress() -> Unavailable:
    return Unavailable(
        "The merged model is being made by an inference worker; download it again in a little while.",
        code="export_in_progress",
        retry_after=10,
    )
