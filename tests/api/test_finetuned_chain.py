"""Jobs started from fine-tuned models: the chain of checkpoints a model id names (every job before
it, oldest first), and the weights a job starts from (each checkpoint applied in order: a full
model's weights, then each LoRA adapter merged: an adapter was trained on its job's starting
weights, not on the base's)."""

from __future__ import annotations

from pathlib import Path

import torch

from service.core.db import session_scope
from service.core.tables import Checkpoint, Job
from service.registry import finetuned, model_ids
from service.tenancy import projects
from tests.helpers.training import LORA, ListRecorder, load_policy, method_config
from worker.engine.methods.rloo import train
from worker.engine.prepare import start_from


def _job(session, project_seq: int, model: str, status: str, ft: str | None) -> Job:  # type: ignore[no-untyped-def]
    job = Job(
        project_seq=project_seq,
        model=model,
        base_model="tiny-policy",
        training_file="file-x",
        seed=0,
        method={"type": "supervised"},
        hyperparameters={},
        status=status,
        total_steps=2,
        fine_tuned_model=ft,
    )
    session.add(job)
    session.flush()
    for step in (1, 2):
        name = model_ids.checkpoint_id(ft or f"ft:tiny-policy:p::{job.id}", step)
        session.add(
            Checkpoint(job_seq=job.seq, step_number=step, path=f"{job.id}/{step}", fine_tuned_model_checkpoint=name)
        )
    return job


def test_a_model_id_names_the_checkpoints_of_every_job_before_it(env) -> None:  # type: ignore[no-untyped-def]
    with session_scope() as session:
        project = projects.get_or_create_project(session=session, name="p")
        other = projects.get_or_create_project(session=session, name="q")
        a = _job(session, project.seq, "tiny-policy", "succeeded", "ft:tiny-policy:p:a:A")
        b = _job(session, project.seq, "ft:tiny-policy:p:a:A:ckpt-step-1", "succeeded", "ft:tiny-policy:p:b:B")
        failed = _job(session, project.seq, "ft:tiny-policy:p:b:B", "failed", "ft:tiny-policy:p:c:C")
        session.commit()

        def chain(name: str, project_seq: int = project.seq, **kw: bool) -> tuple[str, ...] | None:
            found = finetuned.find(session=session, project_seq=project_seq, name=name, **kw)
            return None if found is None else found.chain

        assert chain("ft:tiny-policy:p:a:A") == (f"{a.id}/2",)  # a model: its newest checkpoint
        assert chain("ft:tiny-policy:p:b:B") == (f"{a.id}/1", f"{b.id}/2")  # B started from A's step 1
        assert chain("ft:tiny-policy:p:b:B:ckpt-step-1") == (f"{a.id}/1", f"{b.id}/1")
        # A failed job has no model, only checkpoints; its checkpoint carries the whole chain.
        assert chain("ft:tiny-policy:p:c:C") is None
        assert chain("ft:tiny-policy:p:c:C:ckpt-step-2") == (f"{a.id}/1", f"{b.id}/2", f"{failed.id}/2")
        assert chain("ft:tiny-policy:p:a:A", other.seq) is None  # another project's
        # A deleted model starts no new job; one already started from it keeps its weights.
        b.model_deleted_at = 1
        session.commit()
        assert chain("ft:tiny-policy:p:b:B") is None
        assert chain("ft:tiny-policy:p:b:B", include_deleted=True) == (f"{a.id}/1", f"{b.id}/2")
        # A model whose ancestry was deleted still starts: only the model named is checked.
        assert chain("ft:tiny-policy:p:c:C:ckpt-step-1") == (f"{a.id}/1", f"{b.id}/2", f"{failed.id}/1")


def _final_checkpoint(out: Path) -> Path:
    return max(
        (p for p in out.rglob("*") if (p / "config.json").is_file() or (p / "adapter_config.json").is_file()),
        key=lambda p: int("".join(c for c in p.name if c.isdigit()) or 0),
    )


def test_a_job_starts_from_the_full_model_then_each_adapter_after_it(tmp_path: Path, models_dir: Path) -> None:
    """base -> A (full weights) -> B (LoRA, trained from A): B's model is A's weights with B's
    adapter merged; B's adapter on the base alone (what a chain of one would give) is not."""
    from peft import PeftModel

    a_cfg = method_config(tmp_path / "a", models_dir, "supervised", n_epochs=1, batch_size=8)
    train(a_cfg, ListRecorder())
    a = _final_checkpoint(a_cfg.output_dir)
    started = {"init_from": (a,), "started_from": "ft:tiny-policy:p::ftjob-a"}
    b_cfg = method_config(tmp_path / "b", models_dir, "supervised", cfg=started, n_epochs=1, batch_size=8, lora=LORA)
    b_rec = ListRecorder()
    train(b_cfg, b_rec)
    ready = [e for e in b_rec.events if " ready on " in e]
    assert len(ready) == 1 and ready[0].startswith("Model 'ft:tiny-policy:p::ftjob-a' (base 'tiny-policy') ready")
    b = _final_checkpoint(b_cfg.output_dir)
    assert (b / "adapter_config.json").is_file() and (a / "config.json").is_file()

    def weights(chain: tuple[Path, ...]) -> dict[str, torch.Tensor]:
        base, _ = load_policy(models_dir)
        return {k: v.clone() for k, v in start_from(base, chain, torch.device("cpu")).state_dict().items()}

    def logits(chain: tuple[Path, ...]) -> torch.Tensor:
        base, _ = load_policy(models_dir)
        with torch.no_grad():
            return start_from(base, chain, torch.device("cpu")).eval()(input_ids=ids).logits

    ids = torch.tensor([[5, 6, 7, 8, 9]])
    base, _ = load_policy(models_dir)
    from worker.engine.resume import load_full_weights

    load_full_weights(base, a, torch.device("cpu"))
    with torch.no_grad():  # B's adapter on A's weights, unmerged: what B's job trained
        by_hand = PeftModel.from_pretrained(base, b).eval()(input_ids=ids).logits
    assert torch.allclose(logits((a, b)), by_hand, atol=1e-5)
    assert not torch.allclose(logits((b,)), by_hand, atol=1e-3)
    # A full model's checkpoint holds every weight before it: what came earlier changes nothing.
    only_a = weights((a,))
    assert all(torch.equal(weights((b, a))[k], only_a[k]) for k in only_a)


def test_an_adapter_of_a_tied_output_layer_merges_into_that_layer_alone(tmp_path: Path, models_dir: Path) -> None:
    """The tiny policy ties lm_head to the input embeddings; an adapter on lm_head, merged, must
    change lm_head only, so the merged model (saved and loaded again, as an export is) answers
    what the adapter served unmerged answers, with the input embeddings it had."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base, _ = load_policy(models_dir)
    assert base.get_output_embeddings().weight.data_ptr() == base.get_input_embeddings().weight.data_ptr()
    embeddings = base.get_input_embeddings().weight.detach().clone()
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["lm_head", "q_proj"], init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)
    ids = torch.tensor([[5, 6, 7, 8, 9]])

    served, _ = load_policy(models_dir)
    with torch.no_grad():
        expected = PeftModel.from_pretrained(served, tmp_path / "adapter").eval()(input_ids=ids).logits
    fresh, _ = load_policy(models_dir)
    merged = start_from(fresh, (tmp_path / "adapter",), torch.device("cpu"))
    assert torch.equal(merged.get_input_embeddings().weight, embeddings)
    merged.save_pretrained(tmp_path / "merged")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(again(input_ids=ids).logits, expected, atol=1e-4)
    # ... and that merged model, a full checkpoint in a chain (a Tinker export served, a job started
    # from it), loaded into the tied base, keeps its own head and the base's embeddings
    tied, _ = load_policy(models_dir)
    chained = start_from(tied, (tmp_path / "merged",), torch.device("cpu")).eval()
    assert torch.equal(chained.get_input_embeddings().weight, embeddings)
    with torch.no_grad():
        assert torch.allclose(chained(input_ids=ids).logits, expected, atol=1e-4)
