"""LLM judges: local causal LMs that read chat messages (templates). score_model: the first number
of the judge's greedy answer, clamped into ``range``, is the score; label_model: the label the judge
finds likeliest passes or not. The judge here is the tiny policy taught on the spot to answer "7" to
anything (a real model, loaded the way a job loads one)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from service.graders import GraderError, Sample, grader_to_dict, parse_grader, parse_judge_score, render_judge_messages
from worker.engine.rewards.scoring import RewardModels, score_batch

JUDGE = {
    "type": "score_model",
    "name": "judge",
    "model": "judge-7",
    "input": [
        {"role": "system", "content": "Rate the answer from 0 to 10."},
        {"role": "user", "content": "Question: {{ item.question }}\nAnswer: {{ sample.output_text }}"},
    ],
    "range": [0, 10],
}


@pytest.fixture(scope="module")
def judge_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.tiny.models import build_tiny_causal_lm

    root = tmp_path_factory.mktemp("judges")
    build_tiny_causal_lm(root / "judge-7", seed=0)
    tok = AutoTokenizer.from_pretrained(root / "judge-7")
    model = AutoModelForCausalLM.from_pretrained(root / "judge-7")
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    words = ["sky", "blue", "grass", "green", "what", "color", "is", "the", "answer", "rate"]
    answer = tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for _ in range(80):  # teach it one reply: "7", then EOS, after any rendered conversation
        texts = [
            " ".join(words[int(i)] for i in torch.randint(0, len(words), (int(n),))) for n in torch.randint(1, 12, (8,))
        ]
        chats = [
            [{"role": "system", "content": "Rate the answer from 0 to 10."}, {"role": "user", "content": t}]
            for t in texts
        ]
        ids = [tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True) for c in chats]
        ids = [list(i["input_ids"]) if isinstance(i, dict) or hasattr(i, "keys") else list(i) for i in ids]
        loss = torch.zeros(())
        for prompt in ids:
            seq = torch.tensor([prompt + answer])
            logits = model(input_ids=seq).logits[0, len(prompt) - 1 : -1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(answer))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(root / "judge-7")
    return root


@pytest.mark.parametrize(
    ("answer", "low", "high", "expected"),
    [
        ("7", 0, 10, 7.0),
        ("Score: 8.5/10", 0, 10, 8.5),
        ("-3", 0, 1, 0.0),
        ("12", 1, 10, 10.0),
        ("I cannot rate this.", 0, 1, math.nan),
        ("0.25 then 0.75", 0, 1, 0.25),
        ("1e-1", 0, 1, 0.1),
    ],
)
def test_the_first_number_of_the_answer_clamped_into_the_range(answer, low, high, expected) -> None:
    got = parse_judge_score(answer, low, high)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


def test_the_spec_round_trips_and_bad_specs_name_their_field() -> None:
    grader = parse_grader(JUDGE)
    assert grader_to_dict(grader) == {**JUDGE, "sampling_params": {"max_tokens": 16}}
    # OpenAI's sampling_params and structured content are accepted (the judge answers greedily).
    openai_style = {
        **JUDGE,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Rate: "}, "{{ sample.output_text }}"]}],
        "sampling_params": {
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 1,
            "max_completions_tokens": 8,
            "reasoning_effort": "low",
        },
    }
    judge = parse_grader(openai_style)
    assert judge.input == (("user", "Rate: \n{{ sample.output_text }}"),) and judge.max_tokens == 8
    for bad, param in (
        ({"input": []}, "grader.input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "grader.input.0"),
        ({"input": [{"content": "{{ item.x"}]}, "grader.input.0.content"),
        ({"range": [5, 1]}, "grader.range"),
        ({"range": [0, "10"]}, "grader.range"),
        ({"sampling_params": {"logprobs": True}}, "grader.sampling_params"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "grader.input.0.content.0",
        ),
        ({"sampling_params": {"max_tokens": 0}}, "grader.sampling_params.max_tokens"),
    ):
        with pytest.raises(GraderError) as info:
            parse_grader({**JUDGE, **bad})
        assert info.value.param == param, (bad, info.value)


def test_the_judge_scores_each_sample(judge_models: Path) -> None:
    models = RewardModels(models_dir=judge_models, device=torch.device("cpu"))
    items = [{"question": "What color is the sky?"}, {"question": "Grass?"}, {}]  # the last lacks question
    result = score_batch(
        parse_grader(JUDGE), prompts=[""] * 3, texts=["blue", "green", "x"], items=items, reward_models=models
    )
    assert result.rewards[:2] == [7.0, 7.0] and math.isnan(result.rewards[2])
    # What it read (the two rendered prompts; the third misses its key) and wrote ("7", at least).
    from worker.engine.rewards.scoring import _judge_prompts

    tok = models._load_judge(JUDGE["model"])[1]
    chats = render_judge_messages(parse_grader(JUDGE), [Sample("blue"), Sample("green")], items[:2])
    prompts, special = _judge_prompts(parse_grader(JUDGE), tok, [c for c in chats if c is not None])
    read = sum(len(tok(p, add_special_tokens=special)["input_ids"]) for p in prompts)
    used = models.tokens.take()
    assert read + 2 <= used["judge_tokens"] <= read + 2 * parse_grader(JUDGE).max_tokens, (read, used)
    assert used["reward_model_tokens"] == 0 and models.tokens.take()["judge_tokens"] == 0  # taken: from 0 again
    narrow = parse_grader({**JUDGE, "range": [0, 5]})
    assert score_batch(narrow, prompts=[""], texts=["blue"], items=items[:1], reward_models=models).rewards == [5.0]


@pytest.mark.parametrize("judge", ["score_model", "label_model"])
def test_job_creation_checks_the_judge_model_and_its_item_keys(client, auth, judge: str) -> None:
    from tests.helpers.api import assert_error, upload_ok
    from tests.helpers.data import job_body

    file_id = upload_ok(client, auth)["id"]
    spec = JUDGE if judge == "score_model" else LABELS

    def create(grader: dict) -> object:
        body = job_body(file_id)
        body["method"]["reinforcement"]["grader"] = grader
        return client.post("/v1/fine_tuning/jobs", headers=auth, json=body)

    assert_error(create({**spec, "model": "no-such-judge"}), 400, param="method.reinforcement.grader.model")
    # The demo lines have no "question": the judge's template asks for one.
    resp = create({**spec, "model": "tiny-policy"})
    err = assert_error(resp, 400, param="method.reinforcement.grader")
    assert "item.question" in err["message"], err
    ok = {
        **spec,
        "model": "tiny-policy",
        "input": [{"role": "user", "content": "Q: {{ item.answer }} A: {{ sample.output_text }}"}],
    }
    assert create(ok).status_code == 200


def test_a_job_trains_on_a_judge(judge_models: Path, tmp_path: Path) -> None:
    from tests.helpers.training import ListRecorder, config
    from worker.engine.methods.rloo import train
    from worker.tiny.models import build_tiny_causal_lm

    if not (judge_models / "tiny-policy").exists():  # the policy, beside the judge in this models root
        build_tiny_causal_lm(judge_models / "tiny-policy", seed=0)
    spec = {**JUDGE, "input": [{"role": "user", "content": "{{ item.answer }} / {{ sample.output_text }}"}]}
    rec, cfg = ListRecorder(), config(tmp_path, judge_models, spec, max_steps=1)
    train(cfg, rec)
    assert rec.steps[0]["train_reward_mean"] == 7.0 and rec.steps[0]["graders.judge.mean"] == 7.0
    # What the judge read and wrote is the step's, to be metered: each completion's judging (a prompt
    # of more than one token, an answer of one at least).
    completions = cfg.hyperparameters.batch_size * cfg.hyperparameters.rloo_k
    assert rec.steps[0]["judge_tokens"] >= 3 * completions and rec.steps[0]["reward_model_tokens"] == 0


LABELS = {
    "type": "label_model",
    "name": "verdict",
    "model": "judge-7",
    "input": [
        {"role": "system", "content": {"type": "input_text", "text": "Rate the answer from 0 to 10."}},
        {"role": "user", "content": "Question: {{ item.question }}\nAnswer: {{ sample.output_text }}"},
    ],
    "labels": ["3", "7"],
    "passing_labels": ["7"],
}


def test_a_label_spec_round_trips_and_bad_ones_name_their_field() -> None:
    grader = parse_grader(LABELS)
    assert grader.type == "label_model" and grader.labels == ("3", "7") and grader.passing_labels == ("7",)
    assert parse_grader(grader_to_dict(grader)) == grader
    for bad, param in (
        ({"labels": []}, "grader.labels"),
        ({"labels": ["a", "a"]}, "grader.labels"),
        ({"labels": ["a", " "]}, "grader.labels"),
        ({"labels": "a,b"}, "grader.labels"),
        ({"passing_labels": ["9"]}, "grader.passing_labels"),
        ({"passing_labels": []}, "grader.passing_labels"),
        ({"input": [{"role": "robot", "content": "x"}]}, "grader.input.0"),
        ({"labels": [str(i) for i in range(65)], "passing_labels": ["1"]}, "grader.labels"),
    ):
        with pytest.raises(GraderError) as info:
            parse_grader({**LABELS, **bad})
        assert info.value.param == param, (bad, info.value)
    without = {k: v for k, v in LABELS.items() if k != "passing_labels"}
    with pytest.raises(GraderError, match="passing_labels"):
        parse_grader(without)


def test_the_label_judge_picks_the_label_it_finds_likeliest(judge_models: Path) -> None:
    """The judge taught to answer "7" picks 7 over 3: a pass where 7 passes, a fail where only 3 does;
    a sample whose template misses a key is unscored."""
    models = RewardModels(models_dir=judge_models, device=torch.device("cpu"))
    items = [{"question": "What color is the sky?"}, {"question": "Grass?"}, {}]
    texts = ["blue", "green", "x"]
    passes = score_batch(parse_grader(LABELS), prompts=[""] * 3, texts=texts, items=items, reward_models=models)
    assert passes.rewards[:2] == [1.0, 1.0] and math.isnan(passes.rewards[2])
    fails = parse_grader({**LABELS, "passing_labels": ["3"]})
    assert score_batch(fails, prompts=[""] * 2, texts=texts[:2], items=items[:2], reward_models=models).rewards == [
        0.0,
        0.0,
    ]


def test_a_labels_log_prob_is_the_sum_of_its_tokens_after_the_prompt(judge_models: Path) -> None:
    """Against a hand computation on an untaught model, one unpadded sequence per label: labels of
    different token lengths, batched (and chunked) with padding, get the same log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.tiny.models import build_tiny_causal_lm

    build_tiny_causal_lm(judge_models / "untaught", seed=3)
    labels = ["blue", "green grass", "the color of the sky", "what"]
    grader = parse_grader({**LABELS, "model": "untaught", "labels": labels, "passing_labels": ["what"]})
    tok = AutoTokenizer.from_pretrained(judge_models / "untaught")
    model = AutoModelForCausalLM.from_pretrained(judge_models / "untaught").eval()
    questions = ["What color is the sky?", "Grass?", "Is the answer green?"]
    expected = []
    for question in questions:
        chat = [
            {"role": "system", "content": "Rate the answer from 0 to 10."},
            {"role": "user", "content": f"Question: {question}\nAnswer: yes"},
        ]
        head = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        sums = []
        for label in labels:
            ids = tok(label, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = model(input_ids=torch.tensor([head["input_ids"] + ids])).logits[0].log_softmax(-1)
            sums.append(sum(float(logp[len(head["input_ids"]) - 1 + j, t]) for j, t in enumerate(ids)))
        expected.append(sums)
    items = [{"question": q} for q in questions] + [{}]
    samples = [Sample(output_text="yes")] * 4
    for batch_size in (5, 64):  # one sample's labels per chunk; all samples in one
        models = RewardModels(models_dir=judge_models, device=torch.device("cpu"), batch_size=batch_size)
        got = models.label_logprobs(grader, samples, items)
        assert got[3] is None  # the template's item.question is missing
        heads = sum(len(tok(h, add_special_tokens=False)["input_ids"]) for h in _label_heads(tok, questions))
        label_ids = sum(len(tok(label, add_special_tokens=False)["input_ids"]) for label in labels)
        assert models.tokens.take()["judge_tokens"] == heads * len(labels) + label_ids * len(questions)
        for row, want in zip(got[:3], expected, strict=True):
            assert row == pytest.approx(want, abs=1e-4)
    # A sample passes where its likeliest label is the passing one.
    passing = [float(labels[max(range(4), key=sums.__getitem__)] == "what") for sums in expected]
    assert models.label(grader, samples, items)[:3] == passing


def _label_heads(tok: object, questions: list[str]) -> list[str]:
    """The texts the label judge of ``test_a_labels_log_prob_is_the_sum_of_its_tokens_after_the_prompt`` continues."""
    return [
        tok.apply_chat_template(  # type: ignore[attr-defined]
            [
                {"role": "system", "content": "Rate the answer from 0 to 10."},
                {"role": "user", "content": f"Question: {q}\nAnswer: yes"},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        for q in questions
    ]


def test_a_judges_answer_counts_to_its_first_end_token() -> None:
    """Each row up to its first end token, that one included (padding after it may be an end token
    too); a row cut at max_tokens counts whole; any of the model's end tokens ends a row."""
    from worker.engine.rewards.scoring import written_tokens

    eos, eot, pad = 2, 9, 2  # a tokenizer that pads with its end-of-sequence token; a chat model's end of turn
    written = torch.tensor([[5, 6, eos, pad], [5, eos, pad, pad], [5, 6, 7, 8], [eot, pad, pad, pad]])
    assert written_tokens(written, {eos, eot}, pad) == 3 + 2 + 4 + 1
    assert written_tokens(written, {eos}, pad) == 3 + 2 + 4 + 2  # eot not an end: the row ends at the eos after it
    assert written_tokens(torch.tensor([[5, 0, 0]]), set(), 0) == 1  # no end token known: what is not padding
