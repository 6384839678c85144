"""Bring your own model: each model a request names is checked at the door for the use it is put to
(``service.registry.inspection``, from its files, no weight loaded): a policy is a causal LM with a
tokenizer, a reward model a one-label classifier, a judge a causal LM; an evaluation samples prompt
lines; a completion needs a model that writes text. Each mistake is a 400 that says what to do; a
model without a chat template is accepted and its job says how conversations are rendered."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from service.core.db import session_scope
from service.core.tables import Checkpoint
from service.registry import inspection
from tests.helpers.api import assert_error, create_job, list_ids, upload_ok
from tests.helpers.data import EXAMPLES, STRING_CHECK, job_body
from tests.helpers.rows import job_row

GR = "method.reinforcement.grader"


def _copy_of(models_dir: Path, unique_model_path: Callable[[str], Path], source: str, stem: str) -> Path:
    path = unique_model_path(stem)
    shutil.copytree(models_dir / source, path)
    return path


def test_a_sequence_classifier_as_the_policy_is_a_400_that_names_its_head(client, auth) -> None:
    f = upload_ok(client, auth)
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(f["id"], model="tiny-reward"))
    err = assert_error(resp, 400, param="model", code="invalid_model", contains="sequence classifier")
    assert "ForSequenceClassification" in err["message"] and "reward_model" in err["message"]
    assert list_ids(client, auth, "/v1/fine_tuning/jobs") == []


def test_a_model_without_a_tokenizer_is_a_400_that_says_to_save_one(
    client, auth, models_dir, unique_model_path
) -> None:
    bare = _copy_of(models_dir, unique_model_path, "tiny-policy", "no-tokenizer")
    for name in inspection.TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    f = upload_ok(client, auth)
    for method in ("reinforcement", "supervised"):
        body = job_body(f["id"], model=bare.name)
        if method == "supervised":
            body["method"] = {"type": "supervised"}
        resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=body)
        assert_error(resp, 400, param="model", code="invalid_model", contains="save_pretrained")


def test_a_model_without_a_chat_template_is_accepted_and_its_job_says_how_it_renders(
    client, auth, models_dir, unique_model_path
) -> None:
    plain = _copy_of(models_dir, unique_model_path, "tiny-policy", "no-template")
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    f = upload_ok(client, auth)
    job = create_job(client, auth, job_body(f["id"], model=plain.name))
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=auth).json()["data"]
    said = [e["message"] for e in events if "no chat template" in e["message"]]
    assert len(said) == 1 and "assistant:" in said[0], [e["message"] for e in events]
    with_template = create_job(client, auth, job_body(f["id"]))  # tiny-policy has one: nothing said
    events = client.get(f"/v1/fine_tuning/jobs/{with_template['id']}/events", headers=auth).json()["data"]
    assert not [e for e in events if "chat template" in e["message"]]


@pytest.mark.parametrize(
    ("grader", "says"),
    [
        ({"type": "reward_model", "name": "rm", "model": "tiny-policy"}, "not a sequence classifier"),
        (
            {
                "type": "score_model",
                "name": "judge",
                "model": "tiny-reward",
                "input": [{"role": "user", "content": "Rate {{sample.output_text}} from 0 to 1."}],
            },
            "sequence classifier",
        ),
    ],
)
def test_a_graders_model_unfit_for_its_use_is_a_400_at_its_field(client, auth, grader, says) -> None:
    f = upload_ok(client, auth)
    body = job_body(f["id"])
    body["method"]["reinforcement"]["grader"] = grader
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=body)
    assert_error(resp, 400, param=f"{GR}.model", code="invalid_model", contains=says)


def test_an_evaluation_on_a_file_of_preference_pairs_is_a_400_before_anything_runs(client, auth) -> None:
    f = upload_ok(client, auth)
    job = create_job(client, auth, job_body(f["id"], hp={"n_epochs": 1}))
    pairs = upload_ok(client, auth, (EXAMPLES / "dpo" / "train.jsonl").read_bytes())
    resp = client.post(f"/v1/fine_tuning/jobs/{job['id']}/evaluations", headers=auth, json={"file": pairs["id"]})
    assert_error(resp, 400, param="file", code="invalid_file_format", contains="is not a prompt")
    unknown_key = {**STRING_CHECK, "reference": "{{item.no_such_key}}"}
    resp = client.post(
        f"/v1/fine_tuning/jobs/{job['id']}/evaluations", headers=auth, json={"file": f["id"], "grader": unknown_key}
    )
    assert_error(resp, 400, param="grader", code="missing_item_key", contains="item.no_such_key")


def test_an_evaluation_checks_only_the_lines_it_samples(client, auth) -> None:
    """An evaluation samples the file's first ``samples`` lines: a pair or a missing key after them is
    no reason to refuse it; within them it is."""
    f = upload_ok(client, auth)
    job = create_job(client, auth, job_body(f["id"], hp={"n_epochs": 1}))
    prompts = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(4)]
    pair = (EXAMPLES / "dpo" / "train.jsonl").read_text().splitlines()[0]
    mixed = upload_ok(client, auth, "\n".join([*prompts, pair, ""]).encode())
    url = f"/v1/fine_tuning/jobs/{job['id']}/evaluations"
    assert client.post(url, headers=auth, json={"file": mixed["id"], "samples": 4}).status_code == 200
    resp = client.post(url, headers=auth, json={"file": mixed["id"], "samples": 5})
    assert_error(resp, 400, param="file", code="invalid_file_format", contains="Line 5 of file")
    keyed = {**STRING_CHECK, "reference": "{{item.answer}}"}
    partial = upload_ok(client, auth, "\n".join([*prompts, json.dumps({"prompt": "x"}), ""]).encode())
    ok = client.post(url, headers=auth, json={"file": partial["id"], "samples": 4, "grader": keyed})
    assert ok.status_code == 200, ok.text
    resp = client.post(url, headers=auth, json={"file": partial["id"], "samples": 5, "grader": keyed})
    assert_error(resp, 400, param="grader", code="missing_item_key", contains="line 5 of")


def test_a_completion_from_a_model_that_cannot_write_is_a_400(client, auth) -> None:
    body = {"model": "tiny-reward", "messages": [{"role": "user", "content": "hi"}]}
    resp = client.post("/v1/chat/completions", headers=auth, json=body)
    assert_error(resp, 400, param="model", code="invalid_model", contains="sequence classifier")


def test_the_inspection_reads_files_only_and_sees_a_changed_config(models_dir, unique_model_path) -> None:
    policy = inspection.inspect_model(models_dir / "tiny-policy")
    reward = inspection.inspect_model(models_dir / "tiny-reward")
    assert policy is not None and reward is not None
    assert (policy.head, policy.has_tokenizer, policy.has_chat_template, policy.uses) == (
        "causal_lm",
        True,
        True,
        ["policy"],
    )
    assert (reward.head, reward.num_labels, reward.uses) == ("sequence_classification", 1, ["reward_model"])
    copy = _copy_of(models_dir, unique_model_path, "tiny-reward", "relabelled")
    config = json.loads((copy / "config.json").read_text())
    assert inspection.inspect_model(copy) == reward
    config["num_labels"] = 3
    config["id2label"] = {str(i): f"L{i}" for i in range(3)}
    _rewrite_in_the_same_instant(copy / "config.json", json.dumps(config))
    relabelled = inspection.inspect_model(copy)
    assert relabelled is not None and relabelled.num_labels == 3 and relabelled.uses == []
    with pytest.raises(inspection.Invalid, match="3 labels"):
        inspection.check_reward_model(copy, copy.name, "model")
    assert inspection.head_of(("GPT2LMHeadModel",)) == "causal_lm"
    assert inspection.head_of(("BertModel",)) == "base"
    assert inspection.head_of(()) == "unstated"
    assert inspection.inspect_model(models_dir / "no-such-model") is None


def _rewrite_in_the_same_instant(path: Path, text: str) -> None:
    """Rewrite ``path`` keeping its modification time: what a file system with coarse timestamps
    does to an edit within one tick. The inspection must see the change all the same."""
    before = path.stat()
    path.write_text(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_tokenizer_saved_after_the_first_look_is_seen(models_dir, unique_model_path) -> None:
    bare = _copy_of(models_dir, unique_model_path, "tiny-policy", "tokenizer-later")
    kept = {name: (bare / name).read_bytes() for name in inspection.TOKENIZER_FILES if (bare / name).is_file()}
    for name in kept:
        (bare / name).unlink()
    with pytest.raises(inspection.Invalid, match="no tokenizer"):
        inspection.check_policy(bare, bare.name, "model")
    stamp = bare.stat()
    for name, data in kept.items():
        (bare / name).write_bytes(data)
    os.utime(bare, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # the directory's time alone does not tell
    assert inspection.check_policy(bare, bare.name, "model") == []
    template = (bare / "chat_template.jinja").read_text() if (bare / "chat_template.jinja").is_file() else None
    config = json.loads((bare / "tokenizer_config.json").read_text())
    if template is not None:
        (bare / "chat_template.jinja").unlink()
        config["chat_template"] = template
    config_text = json.dumps(config)
    _rewrite_in_the_same_instant(bare / "tokenizer_config.json", config_text)
    assert inspection.check_policy(bare, bare.name, "model") == []
    config.pop("chat_template")
    _rewrite_in_the_same_instant(bare / "tokenizer_config.json", json.dumps(config))
    assert "no chat template" in inspection.check_policy(bare, bare.name, "model")[0]


@pytest.mark.parametrize(
    ("files", "tokenizer"),
    [
        ({"tekken.json": "{}"}, True),  # Mistral's
        ({"cl100k_base.tiktoken": "x"}, True),
        ({"spm.model": "x"}, True),
        ({"merges.txt": "x"}, False),  # half a BPE vocabulary is not a tokenizer
    ],
)
def test_each_kind_of_tokenizer_file_counts(models_dir, unique_model_path, files, tokenizer) -> None:
    model = _copy_of(models_dir, unique_model_path, "tiny-policy", "tokenizer-kinds")
    for name in inspection.TOKENIZER_FILES:
        (model / name).unlink(missing_ok=True)
    for name, text in files.items():
        (model / name).write_text(text)
    info = inspection.inspect_model(model)
    assert info is not None and info.has_tokenizer is tokenizer


def test_a_processors_chat_template_json_is_not_the_tokenizers_template(models_dir, unique_model_path) -> None:
    model = _copy_of(models_dir, unique_model_path, "tiny-policy", "processor-template")
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    info = inspection.inspect_model(model)
    assert info is not None and not info.has_chat_template  # AutoTokenizer does not read it


def test_a_classifier_whose_config_gives_no_label_count_has_transformers_two(models_dir, unique_model_path) -> None:
    model = _copy_of(models_dir, unique_model_path, "tiny-reward", "two-labels")
    config = json.loads((model / "config.json").read_text())
    for key in ("num_labels", "id2label", "label2id"):
        config.pop(key, None)
    (model / "config.json").write_text(json.dumps(config))
    info = inspection.inspect_model(model)
    assert info is not None and info.num_labels == 2 and info.uses == []
    with pytest.raises(inspection.Invalid, match="2 labels"):
        inspection.check_reward_model(model, model.name, "model")


def test_a_config_that_names_no_architecture_is_loaded_by_its_model_type(
    client, auth, models_dir, unique_model_path
) -> None:
    """transformers loads such a model by ``model_type`` as whatever class is asked for: a policy
    is accepted (not refused as having no head), and the model list says it."""
    model = _copy_of(models_dir, unique_model_path, "tiny-policy", "no-architectures")
    config = json.loads((model / "config.json").read_text())
    del config["architectures"]
    (model / "config.json").write_text(json.dumps(config))
    f = upload_ok(client, auth)
    assert create_job(client, auth, job_body(f["id"], model=model.name))["status"] == "queued"
    listed = client.get(f"/v1/models/{model.name}", headers=auth).json()["rloo"]
    assert listed["uses"] == ["policy"] and listed["architecture"] is None


def test_the_models_list_says_what_each_base_model_can_be_used_for(client, auth) -> None:
    listed = {m["id"]: m for m in client.get("/v1/models", headers=auth).json()["data"]}
    assert listed["tiny-policy"]["rloo"]["uses"] == ["policy"] and listed["tiny-policy"]["rloo"]["chat_template"]
    assert listed["tiny-reward"]["rloo"]["uses"] == ["reward_model"]
    assert listed["tiny-reward"]["rloo"]["architecture"].endswith("ForSequenceClassification")
    one = client.get("/v1/models/tiny-policy", headers=auth).json()
    assert one["owned_by"] == "system" and one["rloo"]["context_length"] > 0


def test_lora_target_modules_the_model_lacks_are_a_400_naming_the_ones_it_has(client, auth) -> None:
    f = upload_ok(client, auth)
    hp_param = "method.reinforcement.hyperparameters"
    resp = client.post(
        "/v1/fine_tuning/jobs", headers=auth, json=job_body(f["id"], hp={"lora": {"target_modules": ["c_attn"]}})
    )
    err = assert_error(resp, 400, param=f"{hp_param}.lora.target_modules", contains="no module named 'c_attn'")
    assert "q_proj" in err["message"] and "all-linear" in err["message"]
    targets = ["lm_head", "q_proj", "embed_tokens"]  # lm_head: tied to the embeddings here, stored by none
    ok = create_job(client, auth, job_body(f["id"], hp={"lora": {"target_modules": targets}}))
    assert ok["status"] == "queued"


def test_lora_target_modules_are_checked_on_a_fine_tuned_models_base_too(client, auth) -> None:
    with session_scope() as session:
        job = job_row(session, "alpha", status="succeeded", fine_tuned_model="ft:tiny-policy:alpha::lora-base")
        session.add(
            Checkpoint(
                job_seq=job.seq,
                step_number=2,
                path=f"{job.id}/2",
                fine_tuned_model_checkpoint="ft:tiny-policy:alpha::lora-base:ckpt-step-2",
            )
        )
        session.commit()
    f = upload_ok(client, auth)
    body = job_body(f["id"], model="ft:tiny-policy:alpha::lora-base", hp={"lora": {"target_modules": ["c_attn"]}})
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=body)
    assert_error(resp, 400, param="method.reinforcement.hyperparameters.lora.target_modules", contains="'c_attn'")
