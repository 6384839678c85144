"""The Tinker training protocol under ``/api/v1/`` (the unmodified ``tinker`` SDK pointed at this
server with ``TINKER_BASE_URL`` and a key of ours in ``TINKER_API_KEY``): sessions, training
models and their requests as futures, checkpoints by ``tinker://`` path.

A training model's requests (create, forward_backward, optim_step, save, load) are queued for the
training worker that holds the model (``service.tinker.bus``; ``worker.sessions``) and answered
as futures the SDK polls with ``retrieve_future``; the rest is answered here. Keys, projects and
rate limits are the rest of the API's (the SDK sends the key as ``X-API-Key``).
"""

from __future__ import annotations

import json
import logging
import time
from functools import lru_cache
from typing import Any

import anyio
from fastapi import APIRouter, Request
from starlette.responses import Response

from service.api.deps import ProjectDep, SessionDep, SettingsDep
from service.api.responses import JSON
from service.api.routing import StrictJSONRoute
from service.api.schemas import tinker as schemas
from service.core.crud import Caller
from service.core.db import ends_session, run_db, session_scope, write_lock
from service.core.errors import Invalid, NotFound, TooLarge, no_inference_worker
from service.core.settings import Settings, get_settings
from service.infra import inference_bus, task_queue
from service.tenancy import quotas
from service.tinker import bus, loss_specs, sampling, sessions, wire

log = logging.getLogger("rloo.api")
router = APIRouter(prefix="/api/v1", route_class=StrictJSONRoute, tags=["tinker"], include_in_schema=False)

LONG_POLL_SECONDS = 20.0
"""How long ``retrieve_future`` waits for an answer before it says ``try_again`` (the SDK's own
request time-out is 45 s)."""


@lru_cache
def redis_conn() -> Any:
    import redis

    return redis.Redis.from_url(get_settings().redis_client_url, socket_timeout=10, socket_connect_timeout=5)


def _future(rid: str, model_id: str) -> JSON:
    return JSON({"request_id": rid, "model_id": model_id})


def _queue(project: int, model_id: str, kind: str, fields: dict[str, Any], payload: bytes | None = None) -> str:
    """Queue a request of a training model (its worker asked for if none holds it); its id. On a
    thread, never on the event loop."""
    conn = redis_conn()
    rid = bus.submit(conn, project=project, model_id=model_id, kind=kind, fields=fields, payload=payload)
    _wake_if_unheld(model_id)
    return rid


def _wake_if_unheld(model_id: str) -> None:
    if bus.needs_worker(redis_conn(), model_id):
        task_queue.wake_tinker_model(model_id)


def bus_conn() -> Any:
    from service.infra.inference_bus import connect_async

    return connect_async()


# Service ------------------------------------------------------------------------------------------------------
@router.get("/healthz")
def healthz() -> JSON:
    return JSON({"status": "ok"})


@router.post("/client/config")
def client_config() -> JSON:
    """The SDK's feature flags for this server: API keys (no JWT exchange), zstd-compressed
    forward_backward bodies, httpx's own transport, futures polled one by one."""
    return JSON(
        {
            "pjwt_auth_enabled": False,
            "credential_default_source": "api_key",
            "proto_compress_fwdbwd": True,
            "use_pyqwest_transport": False,
            "parallel_fwdbwd_chunks": True,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        }
    )


@router.post("/client/dynamic_config")
def client_dynamic_config() -> JSON:
    return JSON({"refresh_interval_sec": 300, "sample_cancel_enabled": True, "sample_cancel_max_batch_size": 64})


@router.post("/telemetry")
def telemetry() -> JSON:
    """The SDK's telemetry: accepted and dropped (nothing of a client's is kept but its requests)."""
    return JSON({"status": "accepted"})


@router.get("/get_server_capabilities")
def get_server_capabilities(_: ProjectDep, settings: SettingsDep) -> JSON:
    return JSON({"supported_models": sessions.capabilities(settings.models_dir)})


@router.post("/create_session")
@ends_session
def create_session(body: schemas.CreateSession, project: ProjectDep, session: SessionDep) -> JSON:
    with write_lock(session):
        row = sessions.create_session(
            session,
            project=project.seq,
            tags=body.tags,
            user_metadata=body.user_metadata or {},
            sdk_version=body.sdk_version,
            name=body.display_name,
        )
        session.commit()
    return JSON({"type": "create_session", "session_id": row.id})


@router.post("/session_heartbeat")
@ends_session
def session_heartbeat(body: schemas.SessionRef, project: ProjectDep, session: SessionDep) -> JSON:
    with write_lock(session):
        sessions.heartbeat(session, project=project.seq, session_id=body.session_id)
        session.commit()
    return JSON({"type": "session_heartbeat"})


# Training models ----------------------------------------------------------------------------------------------
@router.post("/create_model")
@ends_session
def create_model(body: schemas.CreateModel, project: ProjectDep, session: SessionDep, settings: SettingsDep) -> JSON:
    optimizer = body.optimizer_config or {"type": "adamw"}
    if optimizer.get("type", "adamw") != "adamw":
        raise Invalid(
            f"Optimizer '{optimizer.get('type')}' is not served here: use AdamW (the default)",
            param="optimizer_config",
            code="unsupported_optimizer",
        )
    with write_lock(session):
        row = sessions.create_model(
            session,
            project=project.seq,
            session_id=body.session_id,
            model_seq_id=body.model_seq_id,
            base_model=body.base_model,
            lora=body.lora_config.model_dump() if body.lora_config and body.lora_config.rank > 0 else None,
            optimizer={"type": "adamw"},
            user_metadata=body.user_metadata or {},
            models_dir=settings.models_dir,
            accelerators=settings.accelerators,
        )
        session.commit()
    return _future(_queue(project.seq, row.id, "create_model", {}), row.id)


@router.post("/get_info")
@ends_session
def get_info(body: schemas.ModelRef, project: ProjectDep, session: SessionDep, settings: SettingsDep) -> JSON:
    row = sessions.get_model(session, project=project.seq, model_id=body.model_id)
    return JSON(sessions.model_info(row, settings.models_dir))


@router.post("/forward_backward")
async def forward_backward(request: Request, project: ProjectDep) -> JSON:
    """The SDK's protobuf body (zstd-compressed or not), checked here (a body that does not decode,
    a datum past the limits, an unknown loss is a 400 now, not a failed future), then queued as it came."""
    body = await request.body()
    encoding = request.headers.get("content-encoding")
    call = await anyio.to_thread.run_sync(_checked_call, body, encoding, get_settings())
    await anyio.to_thread.run_sync(_owned, project, call.model_id)
    fields = {"encoding": encoding, "seq_id": call.seq_id}
    rid = await anyio.to_thread.run_sync(_queue, project.seq, call.model_id, "forward_backward", fields, body)
    return _future(rid, call.model_id)


def _checked_call(body: bytes, encoding: str | None, settings: Settings) -> wire.ForwardBackwardCall:
    """The body decoded and its batch checked against its loss, or a 400 (413 past a limit) that says
    what to change."""
    try:
        call = wire.decode_forward_backward(
            body,
            content_encoding=encoding,
            max_bytes=settings.tinker_max_request_bytes,
            max_tokens=settings.tinker_max_tokens,
        )
    except wire.WireError as exc:
        if exc.code == "too_large":
            raise TooLarge(exc.message, param=exc.param, code="request_too_large") from None
        raise Invalid(exc.message, param=exc.param, code=exc.code) from None
    inputs = [d.loss_fn_inputs for d in call.data]
    loss_specs.check_inputs(call.loss_fn, inputs, [len(d.tokens) for d in call.data], call.loss_fn_config)
    return call


def _owned(project: Caller, model_id: str) -> None:
    with session_scope() as session:
        sessions.get_model(session, project=project.seq, model_id=model_id)


@router.post("/optim_step")
@ends_session
def optim_step(body: schemas.OptimStep, project: ProjectDep, session: SessionDep) -> JSON:
    if body.adam_params is None:
        raise Invalid(
            "Only AdamW steps are served here: send adam_params (the SDK's AdamParams)",
            param="optimizer_params",
            code="unsupported_optimizer",
        )
    sessions.get_model(session, project=project.seq, model_id=body.model_id)
    fields = {"adam_params": body.adam_params.model_dump(), "seq_id": body.seq_id}
    return _future(_queue(project.seq, body.model_id, "optim_step", fields), body.model_id)


@router.post("/save_weights")
@ends_session
def save_weights(body: schemas.SaveWeights, project: ProjectDep, session: SessionDep) -> JSON:
    return _save(body, project, session, sampler=False)


@router.post("/save_weights_for_sampler")
@ends_session
def save_weights_for_sampler(body: schemas.SaveWeights, project: ProjectDep, session: SessionDep) -> JSON:
    return _save(body, project, session, sampler=True)


def _save(body: schemas.SaveWeights, project: Caller, session: SessionDep, *, sampler: bool) -> JSON:
    sessions.get_model(session, project=project.seq, model_id=body.model_id)
    name = sessions.checked_name(body.path, "") or None
    if name == "resume":
        raise Invalid(
            "'resume' is the name the server saves a model under when it lets it go: choose another", param="path"
        )
    quotas.check_storage(session, project.seq, 1, lock=False)  # a project at its quota saves nothing more
    fields = {
        "name": name,
        "ttl_seconds": body.ttl_seconds if name or not sampler else body.ttl_seconds or 86400,
        "user_metadata": body.user_metadata or {},
        "seq_id": body.seq_id,
    }
    kind = "save_weights_for_sampler" if sampler else "save_weights"
    return _future(_queue(project.seq, body.model_id, kind, fields), body.model_id)


@router.post("/save_weights_external")
@ends_session
def save_weights_external(body: schemas.SaveWeightsExternal, project: ProjectDep, session: SessionDep) -> JSON:
    """The weights as one Hugging Face model directory (LoRA merged into its base), to download with
    the RestClient's ``get_external_weights_urls``."""
    if body.age_encryption_recipients:
        raise Invalid(
            "Encrypted exports are not served here: leave age_encryption_recipients out (the files are "
            "downloaded over this server's own connection)",
            param="age_encryption_recipients",
        )
    sessions.get_model(session, project=project.seq, model_id=body.model_id)
    name = sessions.checked_name(body.path, "")
    quotas.check_storage(session, project.seq, 1, lock=False)
    fields = {"name": name, "ttl_seconds": body.ttl_seconds, "seq_id": body.seq_id}
    return _future(_queue(project.seq, body.model_id, "save_weights_external", fields), body.model_id)


@router.post("/load_weights")
@ends_session
def load_weights(body: schemas.LoadWeights, project: ProjectDep, session: SessionDep, settings: SettingsDep) -> JSON:
    """Weights (and the optimizer, with ``optimizer``) of a saved state, onto an existing model
    (``model_id``) or onto a new one made from the checkpoint's base and LoRA settings
    (``session_id`` + ``model_seq_id``: ``create_training_client_from_state``)."""
    path = sessions.parse_path(body.path)
    checkpoint = sessions.find_checkpoint(session, project=project.seq, path=path)
    if path.kind != "weights":
        raise Invalid(
            "Sampler weights hold no optimizer and no training state: load a path saved by save_state "
            "(tinker://<model>/weights/<name>)",
            param="path",
            code="invalid_path",
        )
    if body.model_id is not None:
        target = sessions.get_model(session, project=project.seq, model_id=body.model_id)
    elif body.session_id is not None and body.model_seq_id is not None:
        source = sessions.get_model(session, project=project.seq, model_id=path.model_id)
        with write_lock(session):
            target = sessions.create_model(
                session,
                project=project.seq,
                session_id=body.session_id,
                model_seq_id=body.model_seq_id,
                base_model=source.base_model,
                lora=source.lora,
                optimizer=source.optimizer,
                user_metadata=body.user_metadata or {},
                models_dir=settings.models_dir,
                accelerators=settings.accelerators,
            )
            session.commit()
    else:
        raise Invalid("Name the model to load into: model_id, or session_id and model_seq_id", param="model_id")
    fields = {"source": checkpoint.path, "path": str(path), "optimizer": body.optimizer, "seq_id": body.seq_id}
    return _future(_queue(project.seq, target.id, "load_weights", fields), target.id)


# Sampling -----------------------------------------------------------------------------------------------------
@router.post("/create_sampling_session")
@ends_session
def create_sampling_session(
    body: schemas.CreateSamplingSession, project: ProjectDep, session: SessionDep, settings: SettingsDep
) -> JSON:
    """A sampling session on a base model or a training model's sampler weights (checked now)."""
    sessions.get_session(session, project=project.seq, session_id=body.session_id)
    if not (body.model_path or body.base_model):
        raise Invalid("Name what to sample: model_path (sampler weights) or base_model", param="base_model")
    named = {"path": body.model_path} if body.model_path else {"base": body.base_model or ""}
    sampling.servable(session, settings, project=project.seq, named=named)
    sampling_id = sampling.session_id_of(path=body.model_path, base_model=body.base_model)
    return JSON({"type": "create_sampling_session", "sampling_session_id": sampling_id})


@router.get("/samplers/{sampler_id}")
@ends_session
def get_sampler(sampler_id: str, project: ProjectDep, session: SessionDep, settings: SettingsDep) -> JSON:
    named = sampling.named_by(sampler_id)
    _, base = sampling.servable(session, settings, project=project.seq, named=named)
    return JSON({"sampler_id": sampler_id, "base_model": base, "model_path": named.get("path")})


@router.post("/asample")
async def asample(body: schemas.Sample, project: ProjectDep, session: SessionDep, settings: SettingsDep) -> JSON:
    """A sample, queued for the inference workers as a request of kind ``tokens``; its answer comes
    through ``retrieve_future``."""
    _refuse_unserved(body)
    _refuse_past_a_share(body, settings)
    named = sampling.named_by(body.sampling_session_id) if body.sampling_session_id else None
    named = named or ({"path": body.model_path} if body.model_path else {"base": body.base_model or ""})
    served, _ = await run_db(session, lambda: sampling.servable(session, settings, project=project.seq, named=named))
    ns = inference_bus.namespace(inference_bus.serve_queue())
    if not await anyio.to_thread.run_sync(inference_bus.live_workers, redis_conn(), ns):
        raise no_inference_worker("sampling")
    rid = await anyio.to_thread.run_sync(lambda: bus.open_future(redis_conn(), project=project.seq, kind="sample"))
    if body.sampling_params.max_tokens is None:
        body.sampling_params.max_tokens = schemas.DEFAULT_MAX_TOKENS
    deadline = time.time() + settings.inference_timeout_seconds
    key = project.key_id or project.id
    envelope = sampling.envelope(body, rid=rid, project=project.id, key=key, served=served, deadline=deadline)
    conn = bus_conn()
    try:
        await inference_bus.submit(conn, ns, envelope)
    finally:
        await conn.aclose()
    return JSON({"request_id": rid, "sample_sequence_ids": sampling.sequence_ids(body.num_samples)})


def _refuse_unserved(body: schemas.Sample) -> None:
    unserved = {
        "prompt_alt_tokens_k": body.prompt_alt_tokens_k > 0,
        "target_prompt_logprobs": body.target_prompt_logprobs is not None,
    }
    for name, asked in unserved.items():
        if asked:
            raise Invalid(f"{name} is not served here yet: leave it unset", param=name, code="unsupported")
    if any(chunk.type != "encoded_text" for chunk in body.prompt.chunks):
        raise Invalid("Images and audio are not served here: send encoded_text chunks", param="prompt")
    count = len(body.prompt_tokens())
    if not count:
        raise Invalid("The prompt has no tokens", param="prompt", code="empty_prompt")
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and not (body.prompt_logprobs or body.topk_prompt_logprobs):
        raise Invalid(
            "prompt_logprobs_last_n applies to prompt log-probs: set prompt_logprobs", param="prompt_logprobs_last_n"
        )
    if last_n is not None and not 1 <= last_n <= count - 1:
        raise Invalid(
            f"prompt_logprobs_last_n must be between 1 and the prompt's length less one ({count - 1})",
            param="prompt_logprobs_last_n",
        )


def _refuse_past_a_share(body: schemas.Sample, settings: Settings) -> None:
    """A sample's rows are a project's share of an inference worker's batch at most, as a chat
    completion's are: said at the door, not by the worker after a queue."""
    most = inference_bus.rows_a_project(settings.inference_max_batch)
    if body.num_samples > most:
        raise Invalid(
            f"num_samples is at most {most} here, three quarters of what an inference worker decodes at once "
            f"(RLOO_INFERENCE_MAX_BATCH, {settings.inference_max_batch}): send several requests of fewer samples",
            param="num_samples",
            code="too_many_completions",
        )


async def _sample_answer(conn: Any, rid: str, seconds: float) -> None:
    """The inference worker's messages for sample ``rid``, up to ``seconds``: its last one settles
    the future (the SDK's protobuf ``SampleResponse``, or the worker's error)."""
    ns = inference_bus.namespace(inference_bus.serve_queue())
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        item = await conn.blpop([f"{ns}:reply:{rid}"], timeout=max(0.01, min(left, 5.0)))
        if item is None:
            continue
        message = json.loads(item[1])
        if message.get("t") == "done":
            await bus.settle(conn, rid, content_type="application/x-protobuf", body=sampling.response_of(message))
            return
        if message.get("t") == "error":
            category = "user" if int(message.get("status", 500)) < 500 else "server"
            failure = json.dumps({"error": str(message.get("message")), "category": category}).encode()
            await bus.settle(conn, rid, content_type="application/json", body=failure, failed=True)
            return


# Futures ------------------------------------------------------------------------------------------------------
@router.post("/retrieve_future")
async def retrieve_future(body: schemas.RetrieveFuture, project: ProjectDep) -> Response:
    """A future's answer once it is done (JSON, or protobuf as the SDK asks for a forward_backward's);
    until then ``try_again`` after up to ``LONG_POLL_SECONDS``. Another project's future is a 404,
    as one that never was. A future whose worker died while running it, or that was sent to the
    state a dead worker lost, is a 410: the SDK raises its retryable error, and the request sent
    again runs on the model as its newest saved state left it."""
    conn = bus_conn()
    try:
        future = await _read(conn, body.request_id, project)
        if future.kind == "sample" and future.status == "pending":
            await _sample_answer(conn, body.request_id, LONG_POLL_SECONDS)
            future = await _read(conn, body.request_id, project)
        elif future.status in ("pending", "running"):
            await bus.wait(conn, body.request_id, LONG_POLL_SECONDS)
            future = await _read(conn, body.request_id, project)
        if future.status == "running" and not await bus.holder_alive(conn, future.model, future.worker):
            return _lost(
                "The worker running this request is gone; the model is back at its last saved state. Send it again."
            )
        if future.status == "lost":  # sent to the state a dead worker lost
            return _lost(json.loads(future.body)["error"])
        if future.status == "pending" and future.kind != "sample":  # its worker may have died before taking it
            await anyio.to_thread.run_sync(_wake_if_unheld, future.model)
        if future.status in ("pending", "running"):
            return JSON({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        return Response(future.body, media_type=future.content_type)
    finally:
        await conn.aclose()


@router.post("/cancel_future")
async def cancel_future(body: schemas.CancelFuture, project: ProjectDep) -> JSON:
    """A sample the client gave up on (the SDK sends this when a sampling future times out or is
    cancelled, as ``sample_cancel_enabled`` tells it): unless it is answered already, it fails as
    cancelled and the inference workers drop its rows at their next token, or never take it. A
    training model's requests are not cancelled: each one changes the model, in the order sent."""
    conn = bus_conn()
    try:
        future = await _read(conn, body.request_id, project)
        if future.kind != "sample":
            raise Invalid(
                "Only a sample can be cancelled: a training model's requests each change the model, in "
                "the order they were sent",
                param="request_id",
                code="not_cancellable",
            )
        failure = json.dumps({"error": "The client cancelled this sample.", "category": "user"}).encode()
        if await bus.settle(conn, body.request_id, content_type="application/json", body=failure, failed=True):
            await inference_bus.cancel(conn, inference_bus.namespace(inference_bus.serve_queue()), body.request_id)
    finally:
        await conn.aclose()
    return JSON({"type": "cancel_future", "request_id": body.request_id})


def _lost(message: str) -> JSON:
    """410: the SDK's retryable error (its future raises RetryableException)."""
    return JSON({"error": {"message": message, "code": "worker_lost"}}, status_code=410)


async def _read(conn: Any, rid: str, project: Caller) -> bus.Future:
    future = await bus.read(conn, rid)
    if future is None or future.project != project.seq:
        raise NotFound(
            f"No request '{rid[:64]}' (answers are kept an hour).", param="request_id", code="request_not_found"
        )
    return future
