"""An inference worker's process: takes requests from Redis (``service.infra.inference_bus``), batches those for
one base model, streams what each row writes back, and between batches does the rest
(``worker.serving.between_batches``): remote reward models' batches, never inside a batch's decoding, and
checkpoint evaluations' decoding. What would hold the loop (a merge, an evaluation's grading and
start) runs on the worker's background thread (``worker.serving.background``), in turn by project.

A batch is formed from every waiting request whose model shares a base (LoRA adapters of one base
decode in one batch, each row through its own adapter), up to ``RLOO_INFERENCE_MAX_BATCH`` rows.
Requests that arrive while a batch decodes wait for the next one. A request's failure (a model that
will not load, a prompt past the context) is its own answer; nothing a request does ends the process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from service.core.settings import get_settings, tenant_safe
from service.infra import inference_bus
from worker.engine.errors import JobError
from worker.serving.background import Background
from worker.serving.decode import Row
from worker.serving.model_cache import ModelCache, Servable
from worker.serving.scoring import Scoring

log = logging.getLogger("rloo.serve")


TAKEN_PAST_ROOM = 2
"""Requests a worker takes a step however full its batch and waiting list (see ``Server._take``)."""
MAX_PENDING = 64
"""Requests a worker holds waiting, at most, taking past its room."""

REWARD_MODELS_KEPT = 2
"""Scoring models (reward models, judges) an inference worker keeps loaded besides the models it
samples from; one more, and it starts afresh."""


@dataclass
class Request:
    envelope: dict[str, Any]
    servable: Servable
    rows: list[Row] = field(default_factory=list)
    prompt_tokens: int = 0
    open_rows: int = 0
    tool_format: str | None = None
    """How the model writes a tool call (``service.tools.calls``), for a chat request that offered
    tools: the API reads its answer's calls in it."""

    @property
    def id(self) -> str:
        return str(self.envelope["id"])

    @property
    def row_count(self) -> int:
        """Completions it asks for: ``n`` for each prompt."""
        return self.rows_of(self.envelope)

    @property
    def project(self) -> str:
        return str(self.envelope.get("project") or inference_bus.SYSTEM_LANE)

    @staticmethod
    def rows_of(envelope: dict[str, Any]) -> int:
        return int(envelope.get("n", 1)) * len(envelope.get("prompts") or [None])


def seed_of(seed: int | None, choice: int) -> int | None:
    """Each choice of a seeded request its own seed, the first the request's own."""
    return None if seed is None else (seed + choice * 0x9E3779B97F4A7C15) % 2**63


class Server:
    def __init__(self, conn: Any, *, worker: str, cache: Any, max_rows: int, between_batches: Any = None) -> None:
        settings = get_settings()
        self.conn, self.worker, self.cache, self.max_rows = conn, worker, cache, max_rows
        self.ns = inference_bus.namespace(inference_bus.serve_queue())
        self.max_tokens = settings.inference_max_tokens
        self.pending: list[Request] = []
        self.requests: list[dict[str, Any]] = []  # taken requests that are no completion, for between batches
        self.active_rows = 0  # rows of the batch decoding now
        self.share = inference_bus.rows_a_project(max_rows)
        """Rows one project's requests may hold of a batch: the rest is kept for others' to join."""
        self.project_rows: dict[str, int] = {}  # rows of the batch decoding now, by project
        self.held: set[str] = set()
        self.between_batches = between_batches
        self._lock = threading.Lock()
        self._rewards: Any = None
        self.scoring = threading.Lock()
        """Held while the scoring models (``rewards()``) score: the loop's remote batches and the
        background thread's model graders take turns."""
        self.background = Background()
        self.warm = threading.Event()
        """Set once the models this worker preloads are loaded (``worker.serving.startup_models``)."""

    def grade(self, lane: str, fn: Any, *args: Any) -> Future[Any]:
        """``fn(*args)`` on the background thread, in ``lane``'s turn, while the loop serves on."""
        return self.background.submit(lane, fn, *args)

    def rewards(self) -> Any:
        """The reward models, judges and embedder that evaluations' graders and remote reward models
        load, kept between them (up to ``REWARD_MODELS_KEPT``; past that, loaded afresh)."""
        if self._rewards is None or len(self._rewards._loaded) >= REWARD_MODELS_KEPT:
            self._rewards = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            from worker.engine.rewards.scoring import RewardModels

            settings = get_settings()
            self._rewards = RewardModels(
                models_dir=settings.models_dir,
                device=self.cache.device,
                embedding_model=settings.embedding_model,
                serving=True,  # a job's remote reward model is scored here (an evaluation's too)
            )
        return self._rewards

    # The process -------------------------------------------------------------------------------------
    def run(self, keep_going: Any = lambda: True, preload: list[Path] | None = None) -> None:
        """Serve until ``keep_going()`` is false, having first loaded ``preload`` (requests that arrive
        meanwhile wait in the queue, and the worker beats)."""
        beat = threading.Thread(target=self._beat, args=(keep_going,), daemon=True, name="serve-heartbeat")
        beat.start()
        inference_bus.heartbeat(self.conn, self.ns, self.worker, [])
        if preload:
            from worker.serving.startup_models import preload as load

            load(self.cache, preload)
        self.warm.set()
        with contextlib.suppress(Exception):  # Redis away for a moment: the heartbeat thread says it next
            inference_bus.heartbeat(self.conn, self.ns, self.worker, [], warm=True)
        while keep_going():
            ready = self.between_batches is not None and self.between_batches.ready
            idle = not self.pending and not self.requests and not ready
            waiting = self.between_batches is not None and self.between_batches.busy  # for its grading: look again soon
            self._take(block=(0.1 if waiting else 1.0) if idle else 0.0)
            self._answer_requests()
            if self.pending:
                self.serve_one_batch()
            elif self.between_batches is not None:
                try:
                    self.between_batches.step()
                except Exception:  # the database away, a bug: logged, and the worker goes on serving
                    log.exception("an evaluation step failed")
                    time.sleep(1.0)

    def _beat(self, keep_going: Any) -> None:
        while keep_going():
            try:
                with self._lock:
                    held = list(self.held)
                inference_bus.heartbeat(self.conn, self.ns, self.worker, held, warm=self.warm.is_set())
                if self.between_batches is not None:
                    self.between_batches.beat()
            except Exception as exc:  # Redis or the database away for a moment: the next beat tries again
                log.warning("heartbeat failed: %s", exc)
            time.sleep(inference_bus.LEASE_REFRESH)

    def _take(self, *, block: float) -> None:
        """Requests taken from Redis (in turn between projects) as room allows, and always a couple:
        the waiting requests of a project at its share of the batch must not keep another project's
        out of the worker, where it can join the batch under way."""
        room = max(0, self.max_rows - self.active_rows - sum(r.row_count for r in self.pending))
        most = max(room, TAKEN_PAST_ROOM if len(self.pending) < MAX_PENDING else 0)
        if most == 0:
            return
        for envelope in inference_bus.take(self.conn, self.ns, self.worker, block=block, most=most):
            with self._lock:
                self.held.add(envelope["id"])
            if envelope.get("kind") in ("chat", "completion", "tokens"):
                if Request.rows_of(envelope) > self.share:  # (the API refuses them: one from elsewhere)
                    message = f"A request may ask for at most {self.share} completions (n times the prompts)."
                    self._answer(envelope["id"], inference_bus.error_message(400, "too_many_completions", message, "n"))
                    continue
                try:  # (an object store's checkpoints are fetched here, once a host)
                    servable = Servable.from_wire(envelope["servable"])
                except (OSError, ValueError) as exc:
                    message = f"The model's checkpoints could not be fetched: {exc}"
                    self._answer(envelope["id"], inference_bus.error_message(500, "model_load_failed", message))
                    continue
                self.pending.append(Request(envelope, servable))
            elif self.between_batches is not None:
                self.requests.append(envelope)  # answered between batches, never inside one's decoding
            else:
                self._answer(envelope["id"], inference_bus.error_message(400, "unsupported", "not served here"))

    def _answer_requests(self) -> None:
        """The taken requests that are no completion (exports, remote reward models' batches), each
        answered by ``between_batches`` (now, or later from the background thread), oldest first."""
        while self.requests and self.between_batches is not None:
            envelope = self.requests.pop(0)
            last = self.between_batches.request(envelope)
            if last is not None:
                self._answer(envelope["id"], last)

    def answer(self, rid: str, last: dict[str, Any]) -> None:
        """A request's last message, from any thread."""
        self._answer(rid, last)

    # A batch -------------------------------------------------------------------------------------------
    def serve_one_batch(self) -> None:
        """The first waiting request's base (requests are taken in turn between projects and keys),
        with the waiting requests that share it, up to ``max_rows`` rows, at most ``share`` of them a
        project's (no request has more), so another project's request can join at the next token."""
        key = self.pending[0].servable.base_key
        batch: list[Request] = []
        rows = 0
        held: dict[str, int] = {}
        for request in (r for r in self.pending if r.servable.base_key == key):
            if rows + request.row_count > self.max_rows:
                break
            if held.get(request.project, 0) + request.row_count > self.share:
                continue  # its project has its share of this batch: the next one
            batch.append(request)
            rows += request.row_count
            held[request.project] = held.get(request.project, 0) + request.row_count
        self.pending = [r for r in self.pending if all(r is not b for b in batch)]
        ready, loaded = [], None
        for request in batch:
            got = self._prepare(request)
            if got is not None:
                loaded = got
                ready.append(request)
        if ready and loaded is not None:
            with self._answering(ready):
                self._decode(loaded, ready)

    @contextlib.contextmanager
    def _answering(self, requests: list[Request]) -> Iterator[None]:
        """A failure inside is the answer of each of ``requests`` still held, never the process's end."""
        try:
            yield
        except JobError as exc:
            self._fail(requests, inference_bus.error_message(500, exc.code, exc.message))
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            message = "The inference worker ran out of GPU memory; send fewer or shorter requests at once."
            self._fail(requests, inference_bus.error_message(503, "out_of_memory", message))
        except Exception as exc:  # a bug or a broken model
            log.exception("inference batch failed")
            message = f"Inference failed: {type(exc).__name__}: {exc}"
            self._fail(requests, inference_bus.error_message(500, "inference_failed", message))

    def _fail(self, requests: list[Request], message: dict[str, Any]) -> None:
        for request in requests:
            if request.id in self.held:
                self._answer(request.id, message)

    def _rows(self, request: Request, loaded: Any, adapter: str | None) -> dict[str, Any] | None:
        """The request's rows (tokenized, checked against the context), or the error that answers it."""
        if request.envelope["kind"] == "tokens":
            return self._token_rows(request, loaded, adapter)
        return self._text_rows(request, loaded, adapter)

    def _token_rows(self, request: Request, loaded: Any, adapter: str | None) -> dict[str, Any] | None:
        """A Tinker sample's rows: its prompt's token ids as given, ``n`` samples, each token's
        log-probability recorded and its end token kept (``stop_ids``: the model's end tokens when the
        request names none; ``[]``: none, to ``max_tokens``)."""
        from worker.engine.rollout.base import _eos_ids
        from worker.serving.decode import end_ids

        env = request.envelope
        if not isinstance(self.cache, ModelCache):  # vLLM: its stop tokens and log-probs are not wired yet
            message = "Tinker sampling is served by the transformers inference workers (not vLLM's) for now."
            return inference_bus.error_message(400, "unsupported", message, "model_path")
        ids = [int(t) for t in env["prompt_ids"]]
        vocab = int(getattr(loaded.model.config.get_text_config(), "vocab_size", 0) or 0)
        if vocab and any(not 0 <= t < vocab for t in ids):  # (on a GPU, a device-side assert for every row)
            message = f"The prompt holds a token id outside this model's vocabulary (0 to {vocab - 1})."
            return inference_bus.error_message(400, "invalid_token", message, "prompt")
        context, asked = loaded.context, int(env["max_tokens"])
        if context is not None and len(ids) + asked > context:
            message = (
                f"This model's maximum context length is {context} tokens: the prompt's {len(ids)} and "
                f"max_tokens {asked} are past it. Shorten the prompt or lower max_tokens."
            )
            return inference_bus.error_message(400, "context_length_exceeded", message, "sampling_params")
        stop_ids = env.get("stop_ids")
        ends = frozenset(
            end_ids(_eos_ids(loaded.model, loaded.tokenizer), loaded.tokenizer) if stop_ids is None else stop_ids
        )
        asks = env.get("scoring") or {}
        for j in range(int(env.get("n", 1))):
            # The prompt is scored once, on the first sample's row (every sample shares it).
            scoring = Scoring(
                prompt=bool(asks.get("prompt")) and j == 0,
                prompt_topk=int(asks.get("prompt_topk") or 0) if j == 0 else 0,
                last_n=asks.get("last_n"),
                sample_topk=int(asks.get("sample_topk") or 0),
            )
            request.rows.append(
                Row(
                    request=request.id,
                    index=j,
                    prompt_ids=ids,
                    max_tokens=asked,
                    temperature=float(env.get("temperature", 1.0)),
                    top_p=float(env.get("top_p", 1.0)),
                    top_k=int(env.get("top_k") or 0),
                    stop=tuple(env.get("stop") or ()),
                    seed=seed_of(env.get("seed"), j),
                    adapter=adapter,
                    stop_ids=ends,
                    logprobs=[],
                    scoring=scoring,
                )
            )
        request.prompt_tokens = len(ids)
        request.open_rows = len(request.rows)
        return None

    def _text_rows(self, request: Request, loaded: Any, adapter: str | None) -> dict[str, Any] | None:
        """A completion's rows: its prompts rendered and tokenized, checked against the context."""
        from worker.engine.data import prompt_text

        env, tok = request.envelope, loaded.tokenizer
        items = [{"messages": env["messages"], "tools": env.get("tools")}] if env["kind"] == "chat" else None
        items = items or [{"prompt": p} for p in env["prompts"]]
        param = "messages" if env["kind"] == "chat" else "prompt"
        context = loaded.context
        try:
            texts = [prompt_text(item, tok) for item in items]
        except JobError as exc:  # a chat template that cannot render these messages
            return inference_bus.error_message(400, exc.code, exc.message, param)
        except Exception as exc:  # noqa: BLE001 - a template's own error (a role it refuses, …)
            return inference_bus.error_message(400, "invalid_messages", f"The chat template refused them: {exc}", param)
        why = inference_bus.past_any_context(context, max(len(text.encode()) for text in texts), param)
        if why is not None:  # never tokenized whole
            return inference_bus.error_message(400, "context_length_exceeded", why, param)
        prompts = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
        longest = max(len(p) for p in prompts)
        asked = env.get("max_tokens")
        if longest == 0:
            return inference_bus.error_message(400, "empty_prompt", "The prompt has no tokens.", param)
        if context is not None and longest + (asked or 1) > context:
            what = f"{longest} in the {param}" + (f", {asked} in the completion" if asked else "")
            return inference_bus.error_message(
                400,
                "context_length_exceeded",
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{longest + (asked or 0)} tokens ({what}). Shorten the {param} or lower max_tokens.",
                param if asked is None or longest >= context else "max_tokens",
            )
        n = int(env.get("n", 1))
        for p, ids in enumerate(prompts):
            room = self.max_tokens if context is None else min(self.max_tokens, context - len(ids))
            for j in range(n):
                request.rows.append(
                    Row(
                        request=request.id,
                        index=p * n + j,
                        prompt_ids=ids,
                        max_tokens=min(asked, room) if asked else room,
                        temperature=float(env.get("temperature", 1.0)),
                        top_p=float(env.get("top_p", 1.0)),
                        stop=tuple(env.get("stop") or ()),
                        seed=seed_of(env.get("seed"), p * n + j),
                        adapter=adapter,
                    )
                )
        request.prompt_tokens = sum(len(p) for p in prompts)
        request.open_rows = len(request.rows)
        if env["kind"] == "chat" and env.get("tools"):
            from service.tools import template_format

            request.tool_format = template_format(getattr(tok, "chat_template", None))
        return None

    def _decode(self, loaded: Any, requests: list[Request]) -> None:
        """Decode ``requests`` on ``loaded``, pushing each step's text; a request for the same base
        that arrives meanwhile (its adapter, if any, loaded already) joins at the next token."""
        key = requests[0].servable.base_key
        running: dict[str, Request] = {}
        self._start(requests, running)

        def gone() -> set[str]:
            live = [rid for rid in running if rid in self.held]
            dropped = inference_bus.cancelled(self.conn, self.ns, live)
            dropped |= {rid for rid in live if float(running[rid].envelope["deadline"]) <= time.time()}
            for rid in dropped:
                self._answer(rid, inference_bus.error_message(499, "cancelled", "The client went away."))
            return dropped | {rid for rid in running if rid not in self.held}

        def joining() -> list[Row]:
            self._take(block=0.0)
            joined = self._joiners(key, loaded)
            self._start(joined, running)
            return [row for r in joined for row in r.rows]

        for deltas in self.cache.decode(loaded, [row for r in requests for row in r.rows], gone, joining):
            self._send(deltas, running)
        self.active_rows = 0
        self.project_rows = {}

    def _joiners(self, key: Any, loaded: Any) -> list[Request]:
        """Waiting requests that can join the batch decoding on ``loaded`` now, within its rows and
        their project's share. One that does not fit keeps its place (those after it wait), unless its
        project has rows decoding already: then a smaller one of another project may pass it."""
        joined: list[Request] = []
        for request in list(self.pending):
            adapter = request.servable.adapter
            if request.servable.base_key != key or (adapter is not None and adapter not in loaded.adapters):
                continue  # another base, or an adapter to load first: the next batch
            mine = self.project_rows.get(request.project, 0)
            if self.active_rows + request.row_count > self.max_rows or mine + request.row_count > self.share:
                if mine:
                    continue
                break
            self.pending.remove(request)
            if self._prepare(request) is not None:
                joined.append(request)
        return joined

    def _prepare(self, request: Request) -> Any:
        """The request's model loaded and its rows made: the loaded model, or None when the request
        failed (a model that will not load, a prompt past the context: its own answer, already sent)."""
        with self._answering([request]):
            loaded, adapter = self.cache.get(request.servable)
            problem = self._rows(request, loaded, adapter)
            if problem is None:
                return loaded
            self._answer(request.id, problem)
        return None

    def _start(self, requests: list[Request], running: dict[str, Request]) -> None:
        starts = [(r.id, {"t": "start", "prompt_tokens": r.prompt_tokens}) for r in requests]
        for (_, start), r in zip(starts, requests, strict=True):
            if r.tool_format is not None:
                start["tool_format"] = r.tool_format
        inference_bus.push(self.conn, self.ns, starts)
        for request in requests:
            running[request.id] = request
            self.active_rows += request.row_count
            self.project_rows[request.project] = self.project_rows.get(request.project, 0) + request.row_count

    def _send(self, deltas: list[Any], running: dict[str, Request]) -> None:
        """One step's text, then the answer of each request whose last row ended."""
        messages: list[tuple[str, dict[str, Any]]] = []
        ended: list[Request] = []
        for d in deltas:
            if d.text:
                messages.append((d.row.request, {"t": "delta", "i": d.row.index, "text": d.text}))
            if d.finish_reason is not None:
                messages.append((d.row.request, {"t": "end", "i": d.row.index, "finish_reason": d.finish_reason}))
                request = running[d.row.request]
                request.open_rows -= 1
                self.active_rows -= 1
                self.project_rows[request.project] -= 1
                if request.open_rows == 0:
                    ended.append(request)
        inference_bus.push(self.conn, self.ns, messages)
        for request in ended:
            completion = sum(row.sampled for row in request.rows)
            usage = {
                "prompt_tokens": request.prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": request.prompt_tokens + completion,
            }
            done: dict[str, Any] = {"t": "done", "usage": usage}
            if request.envelope["kind"] == "tokens":  # a Tinker sample: its tokens, not its text
                done.update(_sample_answer(request.rows))
            self._answer(request.id, done)

    def _answer(self, rid: str, last: dict[str, Any]) -> None:
        if last.get("t") == "error":  # (a model that would not load names its directory)
            last = {**last, "message": tenant_safe(str(last["message"]))}
        inference_bus.finish(self.conn, self.ns, self.worker, rid, last)
        with self._lock:
            self.held.discard(rid)


def memory_budget(device: torch.device, configured_mb: int | None) -> int:
    """Bytes of weights a worker keeps loaded: RLOO_INFERENCE_MEMORY_MB, or half the GPU's memory, or a
    quarter of the host's."""
    if configured_mb:
        return configured_mb * 1024 * 1024
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * 0.5)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.25)


def main(worker: str) -> None:
    """One inference worker process (``rloo worker --serve`` starts it, and starts another should it die)."""
    import redis

    from worker.engine.modeling import pick_device
    from worker.serving import vllm_models
    from worker.serving.between_batches import BetweenBatches

    settings = get_settings()
    torch.set_grad_enabled(False)
    device = pick_device(None)
    conn = redis.Redis.from_url(settings.redis_client_url, socket_timeout=30, socket_connect_timeout=10)
    cache: Any
    if vllm_models.choose(settings, device):
        cache = vllm_models.VLLMModels(
            artifacts_dir=settings.artifacts_dir, gpu_memory_utilization=settings.vllm_gpu_memory_utilization
        )
    else:
        cache = ModelCache(device=device, budget_bytes=memory_budget(device, settings.inference_memory_mb))
    server = Server(conn, worker=worker, cache=cache, max_rows=settings.inference_max_batch)
    # A worker of its own queue (`--serve --queue`, remote reward models) leaves evaluations to the others.
    server.between_batches = BetweenBatches(
        server, evaluations=settings.serve_queue in (None, f"{settings.queue}-serve")
    )
    log.info(
        "inference worker %s on %s (%s), queue %s", worker, device, type(cache).__name__, inference_bus.serve_queue()
    )
    from worker.serving.startup_models import preload_dirs

    parent = os.getppid()  # its supervisor: in a container that is PID 1, so compare, never test for 1
    server.run(lambda: os.getppid() == parent, preload=preload_dirs(settings.inference_preload, settings.models_dir))


def _sample_answer(rows: list[Row]) -> dict[str, Any]:
    """A Tinker sample's last message: each sequence's tokens and log-probs (and top-k where asked),
    the prompt's log-probs (and top-k) where asked."""
    sequences = [
        {
            "tokens": r.tokens,
            "logprobs": r.logprobs,
            "stop_reason": r.finish_reason,
            "topk_logprobs": r.topk_logprobs if r.scoring.sample_topk > 0 else None,
        }
        for r in rows
    ]
    first = rows[0].prompt if rows else None
    return {
        "sequences": sequences,
        "prompt_logprobs": first.logprobs if first else None,
        "topk_prompt_logprobs": first.topk if first else None,
    }
