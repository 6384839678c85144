"""The database schema: SQLAlchemy 2.0 typed models.

Every table has an integer ``seq`` primary key (insertion order, used for stable paging with
``?after=``) and, where the API shows one, a public string ``id`` such as ``ftjob-…``.
Times are unix seconds, as the OpenAI API returns them.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# BigInteger on PostgreSQL, but INTEGER on SQLite so that the column is the rowid alias and autoincrements.
SeqType = BigInteger().with_variant(Integer(), "sqlite")


def now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Project(Base):
    __tablename__ = "projects"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("proj"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    # Archived by the operator: its objects are kept, its keys refused (403 project_archived).
    archived_at: Mapped[int | None] = mapped_column(BigInteger)
    # The operator's limits for it (service.tenancy.quotas): name -> number; None: the defaults.
    quotas: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class ApiKey(Base):
    """An API key, stored as its SHA-256 digest: keys are 256-bit random, so a fast hash is safe."""

    __tablename__ = "api_keys"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("key"))
    project_seq: Mapped[int] = mapped_column(ForeignKey("projects.seq", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    last_used_at: Mapped[int | None] = mapped_column(BigInteger)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger)
    # The operator's key (``rloo keys create --operator``): besides its project's objects, the
    # operator's routes (``GET /v1/workers``).
    operator: Mapped[bool] = mapped_column(default=False, server_default=false())
    # What the key may do (service.tenancy.scopes), in the table's order; None: every project scope
    # (a key made without --scope, or before scopes existed).
    scopes: Mapped[list[Any] | None] = mapped_column(JSON)
    expires_at: Mapped[int | None] = mapped_column(BigInteger)

    project: Mapped[Project] = relationship(lazy="joined")


class File(Base):
    __tablename__ = "files"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("file"))
    project_seq: Mapped[int] = mapped_column(ForeignKey("projects.seq", ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(64))
    bytes: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(32), default="processed")
    # Relative to the artifacts root, never absolute: the root can move.
    path: Mapped[str] = mapped_column(String(1024))
    line_count: Mapped[int] = mapped_column(Integer)
    # {"keys": {key: lines having it}, "first_missing": {key: first line number lacking it}}
    keys_summary: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class Job(Base):
    __tablename__ = "jobs"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("ftjob"))
    project_seq: Mapped[int] = mapped_column(ForeignKey("projects.seq", ondelete="CASCADE"), index=True)
    model: Mapped[str] = mapped_column(String(512))
    training_file: Mapped[str] = mapped_column(String(64), index=True)
    validation_file: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int] = mapped_column(BigInteger)
    suffix: Mapped[str | None] = mapped_column(String(64))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    method: Mapped[dict[str, Any]] = mapped_column()
    hyperparameters: Mapped[dict[str, Any]] = mapped_column()
    status: Mapped[str] = mapped_column(String(32), index=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(1024), index=True)
    # The base model directory the job's weights descend from: its ``model``, or, for a job that
    # starts from a fine-tuned model, that model's base (null on rows older than fine-tuned models).
    base_model: Mapped[str | None] = mapped_column(String(512))
    # The ids of the results files written at the job's end (OpenAI's ``result_files``).
    result_files: Mapped[list[Any] | None] = mapped_column(JSON)
    # DELETE /v1/models/{fine_tuned_model}: the model is gone from /v1/models and cannot start jobs.
    model_deleted_at: Mapped[int | None] = mapped_column(BigInteger)
    integrations: Mapped[list[Any] | None] = mapped_column(JSON)
    # {gpus, accelerator} as the job asked (schemas.Resources); null: one device of any kind.
    resources: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The job's own limit ({"device_hours": 2.5}): at it the job is paused (service.tenancy.quotas).
    budget: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    lane: Mapped[str] = mapped_column(String(64), default="any.1", server_default="any.1")
    """The devices it asks for (``service.infra.task_queue.lane``): a worker's task claims the fairest queued job
    of its own job's lane."""
    worker: Mapped[str | None] = mapped_column(String(256))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Times its worker died while running it (killed, out of memory, host gone); RLOO_MAX_JOB_CRASHES fails it.
    crashes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    heartbeat_at: Mapped[float | None] = mapped_column(Float)
    # When a reconciler found no live worker that consumes the job's queue and said so in an event
    # (once a wait: the next claim clears it).
    waiting_at: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    started_at: Mapped[int | None] = mapped_column(BigInteger)
    finished_at: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        Index("ix_jobs_project_seq_seq", "project_seq", "seq"),
        Index("ix_jobs_status_lane", "status", "lane"),
    )


class JobEvent(Base):
    __tablename__ = "job_events"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("ftevent"))
    job_seq: Mapped[int] = mapped_column(ForeignKey("jobs.seq", ondelete="CASCADE"))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    level: Mapped[str] = mapped_column(String(8), default="info")
    type: Mapped[str] = mapped_column(String(16), default="message")
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    __table_args__ = (Index("ix_job_events_job_seq_seq", "job_seq", "seq"),)


class JobMetric(Base):
    """One row a step. Unique on (job, step): a step replayed after a crash overwrites its row."""

    __tablename__ = "job_metrics"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    job_seq: Mapped[int] = mapped_column(ForeignKey("jobs.seq", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    data: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)

    __table_args__ = (UniqueConstraint("job_seq", "step", name="uq_job_metrics_job_step"),)


class JobSample(Base):
    """A recorded step's prompts with their completions, rewards and advantages (``worker.engine.samples``).
    Unique on (job, step), as metrics are."""

    __tablename__ = "job_samples"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    job_seq: Mapped[int] = mapped_column(ForeignKey("jobs.seq", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    groups: Mapped[list[Any]] = mapped_column()
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)

    __table_args__ = (UniqueConstraint("job_seq", "step", name="uq_job_samples_job_step"),)


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("ftckpt"))
    job_seq: Mapped[int] = mapped_column(ForeignKey("jobs.seq", ondelete="CASCADE"))
    step_number: Mapped[int] = mapped_column(Integer)
    # Relative to the artifacts root.
    path: Mapped[str] = mapped_column(String(1024))
    fine_tuned_model_checkpoint: Mapped[str] = mapped_column(String(1024), index=True)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    bytes: Mapped[int | None] = mapped_column(BigInteger)  # on disk, as saved (a project's stored bytes)
    export_bytes: Mapped[int | None] = mapped_column(BigInteger)
    """Its merged export's bytes while it has one (``service.registry.exports``), also stored bytes."""
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)

    __table_args__ = (UniqueConstraint("job_seq", "step_number", name="uq_checkpoints_job_step"),)


class Eval(Base):
    """An eval of OpenAI's Evals API (``service.evals``): what an item is (``data_source_config``)
    and how an answer is judged (``testing_criteria``). Its runs are ``Evaluation`` rows."""

    __tablename__ = "evals"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_token_id("eval"))
    project_seq: Mapped[int] = mapped_column(ForeignKey("projects.seq", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(256))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    data_source_config: Mapped[dict[str, Any]] = mapped_column()
    """As answered: ``{"type": "custom", "schema": {...}}`` (item and, with samples, sample)."""
    testing_criteria: Mapped[list[Any]] = mapped_column()
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class Evaluation(Base):
    """One run of the evaluation engine (``worker.serving.evaluate``) on an inference worker: either
    an eval's run (``eval_seq``: OpenAI's ``eval.run``, its items answered in ``EvalOutputItem``
    rows and counted in ``summary``) or checkpoints of a job (and its starting model) scored on a
    file (``job_seq``: ``results`` holds a row a model, filled as the work goes)."""

    __tablename__ = "evaluations"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("fteval"))
    project_seq: Mapped[int] = mapped_column(ForeignKey("projects.seq", ondelete="CASCADE"), index=True)
    job_seq: Mapped[int | None] = mapped_column(ForeignKey("jobs.seq", ondelete="CASCADE"), index=True)
    eval_seq: Mapped[int | None] = mapped_column(ForeignKey("evals.seq", ondelete="CASCADE"), index=True)
    name: Mapped[str | None] = mapped_column(String(256))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    data_source: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """An eval run's ``data_source`` as answered (inline content left out: ``items_inline`` holds it)."""
    items_inline: Mapped[list[Any] | None] = mapped_column(JSON)
    """An eval run's ``file_content`` lines, kept apart from what is answered."""
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """An eval run's counts: ``result_counts``, ``per_testing_criteria_results``, ``per_model_usage``."""
    status: Mapped[str] = mapped_column(String(32), default="queued", index=True)
    file_id: Mapped[str | None] = mapped_column(String(64))
    grader: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """A job evaluation's grader; an eval run's are its eval's ``testing_criteria``."""
    settings: Mapped[dict[str, Any]] = mapped_column()
    """samples, temperature, top_p, max_tokens, stop, seed."""
    models: Mapped[list[Any]] = mapped_column()
    """``[{"model": id, "step_number": N or None}]``: a job's starting model first; an eval run's one
    model (a ``completions`` source) or none (a ``jsonl`` source whose lines hold their samples)."""
    results: Mapped[list[Any]] = mapped_column(default=list)
    done: Mapped[int] = mapped_column(Integer, default=0)
    total: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    worker: Mapped[str | None] = mapped_column(String(200))
    heartbeat_at: Mapped[float | None] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    """When a worker first took it: its time budget runs from here, and the project that started one
    longest ago has the next turn."""
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    finished_at: Mapped[int | None] = mapped_column(BigInteger)


class EvalOutputItem(Base):
    """One item of an eval run as answered and graded (OpenAI's ``eval.run.output_item``)."""

    __tablename__ = "eval_output_items"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_token_id("outputitem"))
    run_seq: Mapped[int] = mapped_column(ForeignKey("evaluations.seq", ondelete="CASCADE"))
    datasource_item_id: Mapped[int] = mapped_column(Integer)
    datasource_item: Mapped[dict[str, Any]] = mapped_column()
    sample: Mapped[dict[str, Any]] = mapped_column()
    results: Mapped[list[Any]] = mapped_column()
    status: Mapped[str] = mapped_column(String(16))
    """``pass`` (every criterion passed), ``fail``, or ``error`` (a criterion could not score it)."""
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)

    __table_args__ = (UniqueConstraint("run_seq", "datasource_item_id", name="uq_eval_output_items_item"),)


class Worker(Base):
    """A training worker (``rloo worker``), as it registered itself (``service.jobs.fleet``): its devices
    and the queues it consumes. Its reconciler writes the row at start and its heartbeat every round;
    a worker that stops deletes it, one that dies leaves it to go stale."""

    __tablename__ = "workers"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    # The Celery node name (``rloo-worker-<pid>@<host>``): what the worker's logs and Flower call it.
    id: Mapped[str] = mapped_column(String(255), unique=True)
    host: Mapped[str] = mapped_column(String(255))
    devices: Mapped[int] = mapped_column(Integer)
    accelerator: Mapped[str] = mapped_column(String(32))
    # GiB a device holds (the host's memory on a CPU worker); null when the worker could not tell.
    memory_per_device_gib: Mapped[float | None] = mapped_column(Float)
    queues: Mapped[list[Any]] = mapped_column()
    version: Mapped[str] = mapped_column(String(64))
    started_at: Mapped[int] = mapped_column(BigInteger, default=now)
    heartbeat_at: Mapped[float] = mapped_column(Float)


class IdempotentRequest(Base):
    """A creation made with an ``Idempotency-Key`` header: a retry with the same key gets this answer
    instead of a second file or job. Written in the same transaction as what it created."""

    __tablename__ = "idempotent_requests"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    project_seq: Mapped[int] = mapped_column(ForeignKey("projects.seq", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(255))
    route: Mapped[str] = mapped_column(String(64))
    request_hash: Mapped[str] = mapped_column(String(64))
    response: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)

    __table_args__ = (UniqueConstraint("project_seq", "route", "key", name="uq_idempotent_requests_key"),)


def new_token_id(prefix: str) -> str:
    """An id in OpenAI's newer spelling, ``evt_…``, ``msg_…`` (webhooks)."""
    return f"{prefix}_{secrets.token_hex(12)}"


class WebhookEndpoint(Base):
    """A project's webhook endpoint (OpenAI's ``webhook_endpoint``). ``secret`` signs deliveries,
    so it is kept as is (a digest could not sign); after a rotation that keeps the old one active,
    ``old_secret`` signs beside it until ``old_secret_until``."""

    __tablename__ = "webhook_endpoints"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_token_id("whep"))
    project_seq: Mapped[int] = mapped_column(ForeignKey("projects.seq", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    url: Mapped[str] = mapped_column(String(2048))
    event_types: Mapped[list[Any]] = mapped_column()
    secret: Mapped[str] = mapped_column(String(128))
    old_secret: Mapped[str | None] = mapped_column(String(128))
    old_secret_until: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    updated_at: Mapped[int | None] = mapped_column(BigInteger)


class WebhookDelivery(Base):
    """One event for one endpoint: the outbox row, written in the transaction of the change that
    caused it, sent (and retried) by the workers' side. ``id`` is the ``webhook-id`` header, the
    same on every attempt, so a receiver can drop a repeat."""

    __tablename__ = "webhook_deliveries"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_token_id("msg"))
    endpoint_seq: Mapped[int] = mapped_column(ForeignKey("webhook_endpoints.seq", ondelete="CASCADE"), index=True)
    event_type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column()
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    delivered_at: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),)


class TinkerSession(Base):
    """A Tinker SDK client's session (``service.tinker.sessions``): what its training models and
    sampling clients hang from. The SDK beats it every few seconds; one that stops beating is ended."""

    __tablename__ = "tinker_sessions"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("tks"))
    project_seq: Mapped[int] = mapped_column(ForeignKey("projects.seq", ondelete="CASCADE"), index=True)
    tags: Mapped[list[Any]] = mapped_column(default=list)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(default=dict)
    display_name: Mapped[str | None] = mapped_column(String(200))
    sdk_version: Mapped[str] = mapped_column(String(64), default="")
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[int | None] = mapped_column(BigInteger)


class TinkerModel(Base):
    """A training model of a Tinker session (Tinker's "training run"): its base model, LoRA rank (0:
    full fine-tuning), optimizer, and the newest state a worker saved (where a worker that takes it
    next resumes). ``id`` is the SDK's ``<session>:train:<n>``."""

    __tablename__ = "tinker_models"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(128), unique=True)
    project_seq: Mapped[int] = mapped_column(ForeignKey("projects.seq", ondelete="CASCADE"), index=True)
    session_seq: Mapped[int] = mapped_column(ForeignKey("tinker_sessions.seq", ondelete="CASCADE"), index=True)
    base_model: Mapped[str] = mapped_column(String(1024))
    lora: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """Tinker's LoraConfig (rank, seed, train_mlp, train_attn, train_unembed); null: full fine-tuning."""
    optimizer: Mapped[dict[str, Any]] = mapped_column(default=dict)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(default=dict)
    steps: Mapped[int] = mapped_column(Integer, default=0)
    """optim_steps applied."""
    state_path: Mapped[str | None] = mapped_column(String(1024))
    """The newest saved state (relative to the artifacts root), with its optimizer."""
    state_steps: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    last_request_at: Mapped[float | None] = mapped_column(Float)


class TinkerCheckpoint(Base):
    """A saved state (``weights``: weights and optimizer, to resume) or sampler weights
    (``sampler_weights``: what an inference worker serves) of a training model, named by its
    ``tinker://<model>/<kind>/<name>`` path."""

    __tablename__ = "tinker_checkpoints"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    model_seq: Mapped[int] = mapped_column(ForeignKey("tinker_models.seq", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(255))
    path: Mapped[str] = mapped_column(String(1024))
    """Relative to the artifacts root."""
    step: Mapped[int] = mapped_column(Integer, default=0)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    expires_at: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (UniqueConstraint("model_seq", "kind", "name", name="uq_tinker_checkpoints_name"),)


class TinkerStep(Base):
    """One ``optim_step`` of a training model, with what its ``forward_backward`` calls since the step
    before added up: the loss (the sum of their ``loss:sum``), what it was counted over (the weights'
    sum for ``cross_entropy``; for the RL losses, the tokens with an advantage) and AdamW's metrics.
    A model loaded back to step n (``load_state``, a worker's death) rewrites its steps after n."""

    __tablename__ = "tinker_steps"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    model_seq: Mapped[int] = mapped_column(ForeignKey("tinker_models.seq", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    """Null where it diverged (NaN or infinite: SQLite keeps no NaN)."""
    counted: Mapped[float] = mapped_column(Float)
    datums: Mapped[int] = mapped_column(Integer)
    tokens: Mapped[int] = mapped_column(Integer)
    loss_fn: Mapped[str] = mapped_column(String(32))
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)

    __table_args__ = (Index("uq_tinker_steps_step", "model_seq", "step", unique=True),)


class AuditEvent(Base):
    """One mutating request or admin action (service.tenancy.audit): who (the key, never its secret),
    in which project, what (the route, the object), how it ended, from where, when."""

    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_project", "project_seq", "seq"),)

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("audit"))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now, index=True)
    project_seq: Mapped[int] = mapped_column(ForeignKey("projects.seq", ondelete="CASCADE"))
    key_id: Mapped[str] = mapped_column(String(64))
    operator: Mapped[bool] = mapped_column(default=False)
    action: Mapped[str] = mapped_column(String(256))  # "POST /v1/fine_tuning/jobs/{job_id}/cancel"
    object_id: Mapped[str | None] = mapped_column(String(256))
    outcome: Mapped[str] = mapped_column(String(16))  # succeeded, refused, failed
    status: Mapped[int] = mapped_column(Integer)
    error_code: Mapped[str | None] = mapped_column(String(64))
    client: Mapped[str] = mapped_column(String(64), default="")

    @staticmethod
    def new_id() -> str:
        return new_id("audit")


class UsageRecord(Base):
    """What a job or a key's inference used in one hour (service.tenancy.usage): one row a subject,
    kind, accelerator and hour, added to as it runs."""

    __tablename__ = "usage_records"
    __table_args__ = (
        Index("uq_usage_records_bucket", "subject", "kind", "accelerator", "hour", unique=True),
        Index("ix_usage_records_project_hour", "project_seq", "hour"),
    )

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    project_seq: Mapped[int] = mapped_column(ForeignKey("projects.seq", ondelete="CASCADE"))
    subject: Mapped[str] = mapped_column(String(128))  # a job's id, or "inference:<key id>"
    kind: Mapped[str] = mapped_column(String(64))  # device_seconds, tokens_trained, tokens_sampled, ...
    accelerator: Mapped[str] = mapped_column(String(32), default="")  # device_seconds: the kind of device
    hour: Mapped[int] = mapped_column(BigInteger)  # the hour's start, Unix time
    amount: Mapped[float] = mapped_column(Float)
