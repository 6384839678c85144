"""A job's memory plan (``service.registry.memory_plan``): the model's shape read from its files as torch counts
it, each part worked by hand on the tiny policy, ``POST /v1/fine_tuning/jobs/estimate``, and the
refusal at creation of a job that fits none of the accelerators the operator declared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.jobs.hyperparameters import ReinforcementHyperparameters
from service.registry import memory_plan
from tests.helpers.api import assert_error, upload_ok
from tests.helpers.data import job_body


@pytest.fixture
def shape(models_dir: Path) -> memory_plan.Shape:
    return memory_plan.model_shape(models_dir / "tiny-policy")


def test_the_shape_is_read_from_the_files_as_torch_counts_it(shape: memory_plan.Shape, models_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models_dir / "tiny-policy")
    assert shape.parameters == sum(p.numel() for p in model.parameters())  # tied head counted once
    linear = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if type(m).__name__ == "Linear"}
    linear.pop("lm_head")
    assert {name: (i, o) for name, i, o in shape.linear} == linear
    assert (shape.layers, shape.hidden, shape.intermediate, shape.kv_width, shape.vocab, shape.context) == (
        2,
        64,
        256,
        64,
        512,
        256,
    )


def _hp(**values: Any) -> Any:
    return ReinforcementHyperparameters(**values).resolved()


def test_each_part_of_a_full_fine_tuning_plan_by_hand(shape: memory_plan.Shape) -> None:
    # batch 4 x k 2 = 8 rows of 200 + 8 = 208 tokens, micro-batches of 2 prompts = 4 rows, fp32 (cpu).
    hp = _hp(batch_size=4, rloo_k=2, gradient_accumulation_steps=2, max_prompt_length=200, max_new_tokens=8)
    out = memory_plan.plan(shape, hp, method="reinforcement", device="cpu")
    p = shape.parameters
    per_layer = 9 * 64 + 4 * 64 + 4 * 256  # 1856 values a token a layer
    assert out["bytes"] == {
        "weights": 4 * p,
        "gradients": 4 * p,
        "optimizer": 8 * p,
        "reference": 4 * p,  # kl_coef 0.05: a frozen copy
        "kv_cache": 4 * 2 * 2 * 64 * 208 * 8,
        "sampling_weights": 0,  # one device: nothing gathered
        # 2 prompts' 200 tokens once, the 4 rows' 8 completion tokens each; logits of the 4 x 8 scored.
        "activations": 4 * (2 * 200 + 4 * 8) * 2 * per_layer + 4 * 4 * 8 * 512 * 3,
        "runtime": 200 * 2**20,
    }
    assert out["bytes_per_device"] == 20 * p + out["bytes"]["activations"] + 200 * 2**20  # the larger of the two
    assert out["step_flops"] == {
        "generate": 2 * p * 8 * 8,
        "reference": 2 * p * 8 * 208,
        "update": 6 * p * 8 * 208,
        "total": 2 * p * 8 * 8 + 8 * p * 8 * 208,
    }


def test_lora_trains_only_its_adapters_and_needs_no_reference_copy(shape: memory_plan.Shape) -> None:
    hp = _hp(lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}, gradient_checkpointing=True)
    out = memory_plan.plan(shape, hp, method="reinforcement", device="cuda")
    trainable = 2 * 2 * 4 * (64 + 64)  # 2 layers x (q_proj, v_proj) x r (in + out)
    assert out["trainable_parameters"] == trainable
    assert out["bytes"]["gradients"] == 4 * trainable and out["bytes"]["optimizer"] == 8 * trainable
    assert out["bytes"]["reference"] == 0
    everything = memory_plan.plan(shape, _hp(lora={"r": 4}), method="reinforcement", device="cuda")
    assert everything["trainable_parameters"] == sum(4 * (i + o) for _, i, o in shape.linear)  # all-linear
    # bf16 on CUDA halves the activations; checkpointing keeps each layer's input and one layer whole,
    # every row its whole sequence.
    rows, seq = 8 * 4, 256  # 512 + 64 tokens, cut to the context
    assert out["bytes"]["activations"] == 2 * rows * seq * (2 * 64 + 1856) + 4 * rows * 64 * 512 * 3


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # nothing backend-specific
def test_estimate_answers_the_plan_and_a_job_too_large_for_every_accelerator_is_refused(
    client: Any, auth: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.core.settings import get_settings

    file_id = upload_ok(client, auth)["id"]
    r = client.post("/v1/fine_tuning/jobs/estimate", json=job_body(file_id), headers=auth)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["object"] == "fine_tuning.job.estimate" and plan["model"] == "tiny-policy" and plan["fits"] == {}
    assert plan["bytes_per_device"] > plan["bytes"]["weights"] > 0
    assert client.get("/v1/fine_tuning/jobs", headers=auth).json()["data"] == []  # nothing created

    need = plan["bytes_per_device"] / 2**30
    monkeypatch.setenv("RLOO_ACCELERATORS", f'{{"small": {need / 2}, "big": {need * 2}}}')
    get_settings.cache_clear()
    assert client.post("/v1/fine_tuning/jobs/estimate", json=job_body(file_id), headers=auth).json()["fits"] == {
        "small": False,
        "big": True,
    }
    assert client.post("/v1/fine_tuning/jobs", json=job_body(file_id), headers=auth).status_code == 200
    monkeypatch.setenv("RLOO_ACCELERATORS", f'{{"small": {need / 2}}}')
    get_settings.cache_clear()
    error = assert_error(
        client.post("/v1/fine_tuning/jobs", json=job_body(file_id), headers=auth),
        400,
        code="insufficient_memory",
        param="method.reinforcement.hyperparameters",
    )
    assert "GiB a device" in error["message"] and "lora" in error["message"] and "small" in error["message"]
    # A LoRA job with gradient checkpointing and small micro-batches fits where the full one did not.
    lean = job_body(
        file_id, hp={"lora": {"r": 4}, "gradient_checkpointing": True, "gradient_accumulation_steps": 8, "kl_coef": 0}
    )
    r = client.post("/v1/fine_tuning/jobs/estimate", json=lean, headers=auth)
    assert r.json()["bytes_per_device"] < plan["bytes_per_device"]


def test_sharding_over_devices_divides_the_states_and_each_rank_holds_its_rows(shape: memory_plan.Shape) -> None:
    hp = _hp(batch_size=4, rloo_k=2, gradient_accumulation_steps=2, max_prompt_length=200, max_new_tokens=8)
    one = memory_plan.plan(shape, hp, method="reinforcement", device="cpu")
    two = memory_plan.plan(shape, hp, method="reinforcement", device="cpu", devices=2)
    p = shape.parameters
    assert two["devices"] == 2 and one["devices"] == 1
    assert two["bytes"]["weights"] == -(-4 * p // 2) + 4 * p // shape.layers  # its shard, one layer gathered
    assert two["bytes"]["gradients"] == -(-4 * p // 2) and two["bytes"]["optimizer"] == -(-8 * p // 2)
    assert two["bytes"]["reference"] == -(-4 * p // 2)
    assert two["bytes"]["kv_cache"] == one["bytes"]["kv_cache"] // 2  # 4 of the 8 rows a rank
    # While it samples, a rank holds the policy's whole weights: the rest of them beside its shard.
    assert two["bytes"]["sampling_weights"] == 4 * p - two["bytes"]["weights"] and one["bytes"]["sampling_weights"] == 0
    fixed = sum(two["bytes"][k] for k in ("weights", "gradients", "optimizer", "reference", "runtime"))
    sampling = two["bytes"]["kv_cache"] + two["bytes"]["sampling_weights"]
    assert two["bytes_per_device"] == fixed + max(sampling, two["bytes"]["activations"])
    assert two["rows_per_micro_batch"] == one["rows_per_micro_batch"] // 2
    assert two["step_flops"] == one["step_flops"]  # the same work, spread


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # nothing backend-specific
def test_a_job_asks_for_devices_and_is_refused_what_the_ranks_cannot_share(
    client: Any, auth: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.core.settings import get_settings

    file_id = upload_ok(client, auth)["id"]
    plain = client.post("/v1/fine_tuning/jobs", json=job_body(file_id), headers=auth).json()
    assert plain["resources"] == {"gpus": 1, "accelerator": None}
    body = job_body(file_id, hp={"batch_size": 4}, resources={"gpus": 2})
    job = client.post("/v1/fine_tuning/jobs", json=body, headers=auth).json()
    assert job["resources"] == {"gpus": 2, "accelerator": None}
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=auth).json()["resources"] == job["resources"]
    plan = client.post("/v1/fine_tuning/jobs/estimate", json=body, headers=auth).json()
    assert plan["devices"] == 2

    error = assert_error(
        client.post(
            "/v1/fine_tuning/jobs",
            json=job_body(file_id, hp={"batch_size": 4, "gradient_accumulation_steps": 4}, resources={"gpus": 2}),
            headers=auth,
        ),
        400,
        param="method.reinforcement.hyperparameters.batch_size",
    )
    assert "2 x 4 = 8" in error["message"]
    supervised = {"model": "tiny-policy", "training_file": file_id, "resources": {"gpus": 2}}
    assert_error(client.post("/v1/fine_tuning/jobs", json=supervised, headers=auth), 400, param="resources.gpus")
    for bad in ({"gpus": 0}, {"gpus": 65}, {"accelerator": "H 100"}, {"cpus": 2}):
        r = client.post("/v1/fine_tuning/jobs", json=job_body(file_id, resources=bad), headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("resources"), r.text

    # A kind the operator did not declare; a declared kind narrows the plan's fits to it.
    monkeypatch.setenv("RLOO_ACCELERATORS", '{"h100": 80, "l4": 24}')
    get_settings.cache_clear()
    error = assert_error(
        client.post("/v1/fine_tuning/jobs", json=job_body(file_id, resources={"accelerator": "a100"}), headers=auth),
        400,
        param="resources.accelerator",
    )
    assert "h100, l4" in error["message"]
    r = client.post(
        "/v1/fine_tuning/jobs/estimate", json=job_body(file_id, resources={"accelerator": "l4"}), headers=auth
    )
    assert r.json()["fits"] == {"l4": True}
