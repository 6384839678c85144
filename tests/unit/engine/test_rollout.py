"""Rollouts on the tiny policy: layout, padding, EOS, and log-probs on completion positions only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.training import load_policy
from worker.engine.rollout.base import Sampling, completion_logprobs, completion_mask_from
from worker.engine.rollout.transformers_backend import TransformersBackend

PROMPTS = ["What color is the sky?", "Grass?", "What color is a ripe banana, usually, at noon?"]


@pytest.fixture(scope="module")
def policy(models_dir: Path) -> tuple[Any, Any]:
    return load_policy(models_dir)


def backend(policy: tuple[Any, Any], **kw: Any) -> TransformersBackend:
    model, tok = policy
    args = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "max_prompt_length": 64, **kw}
    return TransformersBackend(model, tok, Sampling(**args))


def test_completion_mask_by_hand() -> None:
    eos = 2
    ids = torch.tensor([[5, eos, 7, 8], [5, 6, 7, 8], [eos, 9, 9, 9], [5, 6, 7, eos]])
    mask, truncated = completion_mask_from(ids, [eos])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]  # EOS itself carries loss
    assert truncated.tolist() == [False, True, False, False]
    mask, _ = completion_mask_from(torch.tensor([[5, 3, 7, 2]]), [2, 3])  # any of several EOS ids ends it
    assert mask.tolist() == [[1, 1, 0, 0]]


def test_layout_is_prompt_major_left_padded_and_encoded_once(policy, monkeypatch) -> None:
    model, tok = policy
    calls = []
    real_call = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, *a, **kw: calls.append(1) or real_call(self, *a, **kw))
    ro = backend(policy).generate(PROMPTS, k=4, generator_seed=1)
    assert len(calls) == 1  # one encoding of the batch, shared by each prompt's k samples
    n, width = ro.prompt_ids.shape
    assert n == 12 and ro.completion_ids.shape[0] == 12 and len(ro.texts) == 12
    for b, prompt in enumerate(PROMPTS):
        rows = ro.prompt_ids[b * 4 : b * 4 + 4]
        assert (rows == rows[0]).all()  # rows b*k .. b*k+k-1 are prompt b
        real = ro.prompt_mask[b * 4].bool()
        assert tok.decode(rows[0][real]) == prompt
        # Left padding: the real tokens are the last ones of the row.
        assert real[width - int(real.sum()) :].all() and not real[: width - int(real.sum())].any()
    # Four samples of the same prompt are not all the same (sampling is on).
    assert len({tuple(r.tolist()) for r in ro.completion_ids[:4]}) > 1


def test_tokens_after_eos_are_padding_and_out_of_the_text(policy) -> None:
    model, tok = policy
    ro = backend(policy, max_new_tokens=24, temperature=3.0).generate(PROMPTS, k=8, generator_seed=3)
    ended = (~ro.truncated).nonzero().flatten().tolist()
    assert ended, "no completion ended with EOS; raise the temperature or the length"
    for i in ended:
        length = int(ro.completion_mask[i].sum())
        assert ro.completion_ids[i, length - 1].item() in (tok.eos_token_id,)
        assert (ro.completion_ids[i, length:] == tok.pad_token_id).all()
        assert ro.texts[i] == tok.decode(ro.completion_ids[i, : length - 1], skip_special_tokens=True)


def test_logprobs_only_on_completion_positions_equal_a_full_forward(policy) -> None:
    model, tok = policy
    ro = backend(policy).generate(PROMPTS, k=2, generator_seed=5)
    with torch.no_grad():
        logp, entropy = completion_logprobs(model, ro, temperature=0.7, with_entropy=True)
        # Reference: every position through the LM head, then the completion's slice.
        pos = (ro.attention_mask.cumsum(1) - 1).clamp(min=0)
        full = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask, position_ids=pos).logits
        p = ro.prompt_ids.shape[1]
        want = torch.log_softmax(full[:, p - 1 : -1].float() / 0.7, -1)
        want = want.gather(-1, ro.completion_ids.unsqueeze(-1)).squeeze(-1)
    mask = ro.completion_mask.bool()
    torch.testing.assert_close(logp[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert entropy is not None and (entropy[mask] > 0).all()


def test_left_padding_does_not_change_a_prompts_logprobs(policy) -> None:
    """A short prompt batched with a long one (so padded) scores its completion as it would alone."""
    model, tok = policy
    ro = backend(policy).generate(PROMPTS, k=1, generator_seed=7)
    with torch.no_grad():
        batched, _ = completion_logprobs(model, ro, temperature=1.0)
        alone_ro = ro.rows(slice(1, 2))
        # Strip the short prompt's padding: the same tokens, no pad columns.
        keep = alone_ro.prompt_mask[0].bool()
        alone_ro.prompt_ids, alone_ro.prompt_mask = alone_ro.prompt_ids[:, keep], alone_ro.prompt_mask[:, keep]
        alone, _ = completion_logprobs(model, alone_ro, temperature=1.0)
    mask = ro.completion_mask[1].bool()
    torch.testing.assert_close(batched[1][mask], alone[0][mask], rtol=1e-4, atol=1e-4)


def test_nucleus_keeps_the_smallest_set_reaching_top_p() -> None:
    from worker.engine.rollout.base import _nucleus

    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    # Ranked: 0.5, 0.25 (0.75 so far), 0.15 (0.90), 0.1. top_p 0.8 keeps 0.5, 0.25, 0.15.
    torch.testing.assert_close(_nucleus(probs, 0.8), torch.tensor([[0.0, 0.5, 0.15, 0.25]]))
    torch.testing.assert_close(_nucleus(probs, 0.5), torch.tensor([[0.0, 0.5, 0.0, 0.0]]))  # the top token alone
    torch.testing.assert_close(_nucleus(probs, 1.0), probs)


def test_top_p_sampling_never_draws_outside_the_nucleus(policy) -> None:
    from worker.engine.rollout.base import _nucleus

    model, tok = policy
    ro = backend(policy, top_p=0.05, max_new_tokens=1).generate(PROMPTS, k=16, generator_seed=11)
    for b, prompt in enumerate(PROMPTS):
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)
        nucleus = set(_nucleus(probs.unsqueeze(0), 0.05)[0].nonzero().flatten().tolist())
        assert len(nucleus) < 64  # a narrow set: the check below can fail
        assert set(ro.completion_ids[b * 16 : b * 16 + 16, 0].tolist()) <= nucleus


def test_a_prompts_completions_do_not_depend_on_the_prompts_beside_it(policy) -> None:  # type: ignore[no-untyped-def]
    """Each prompt group draws from its own generator: the batch split in two (as two ranks take
    it, ``first`` their place in it) samples exactly what the whole batch samples."""
    whole = backend(policy, max_new_tokens=12, temperature=2.0).generate(PROMPTS, k=3, generator_seed=23)
    half = len(PROMPTS) // 2
    head = backend(policy, max_new_tokens=12, temperature=2.0).generate(PROMPTS[:half], k=3, generator_seed=23)
    tail = backend(policy, max_new_tokens=12, temperature=2.0).generate(
        PROMPTS[half:], k=3, generator_seed=23, first=half
    )
    assert head.texts + tail.texts == whole.texts
    assert len(set(whole.texts)) > 2  # the rows really were sampled, and differently
    shifted = backend(policy, max_new_tokens=12, temperature=2.0).generate(PROMPTS[half:], k=3, generator_seed=23)
    assert shifted.texts != tail.texts  # the place in the batch is part of the seed


def test_sampling_draws_each_token_at_its_probability_and_never_a_zero() -> None:
    from worker.engine.rollout.base import sample

    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    logits = probs.clamp(min=1e-45).log().expand(200_000, -1)  # -inf-like where the probability is 0
    uniform = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(sample(logits, 1.0, 1.0, uniform), minlength=6).float()
    freq = counts / counts.sum()
    # Four standard errors of a frequency over 200k draws.
    tolerance = 4 * (probs * (1 - probs) / 200_000).sqrt() + 1e-9
    assert ((freq - probs).abs() <= tolerance).all(), freq
    assert counts[1] == 0 and counts[5] == 0  # a zero-probability token is never drawn, even the last
    # With the nucleus at 0.7: only tokens 0 and 2, in proportion 5:3.
    uniform = torch.rand(200_000, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(sample(logits, 1.0, 0.7, uniform), minlength=6).float()
    assert counts[[1, 3, 4, 5]].sum() == 0
    assert abs(counts[0] / counts.sum() - 0.625) < 4 * (0.625 * 0.375 / 200_000) ** 0.5


def test_sampling_at_a_low_temperature_is_greedy_decoding(policy) -> None:
    """The lean loop (prompt prefilled once, its cache shared by the k rows, padded rows, the 4-D
    decode mask) follows each prompt exactly as transformers' greedy generate() on it alone."""
    model, tok = policy
    ro = backend(policy, max_new_tokens=8, temperature=1e-4).generate(PROMPTS, k=2, generator_seed=13)
    for b, prompt in enumerate(PROMPTS):
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            want = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=8,
                pad_token_id=tok.pad_token_id,
            )[0, ids.shape[1] :]
        for row in (2 * b, 2 * b + 1):
            n = int(ro.completion_mask[row].sum())
            assert ro.completion_ids[row, :n].tolist() == want[:n].tolist()


def test_the_4d_decode_mask_draws_the_same_tokens_as_the_2d_one(policy, monkeypatch) -> None:
    import worker.engine.rollout.transformers_backend as rollout

    assert rollout._decode_mask_is_padding_only(policy[0].config)
    fast = backend(policy, max_new_tokens=12, temperature=2.0).generate(PROMPTS, k=4, generator_seed=17)
    monkeypatch.setattr(rollout, "_decode_mask_is_padding_only", lambda config: False)
    plain = backend(policy, max_new_tokens=12, temperature=2.0).generate(PROMPTS, k=4, generator_seed=17)
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    assert len(set(map(tuple, fast.completion_ids.tolist()))) > 4  # high temperature: the rows differ


def test_a_shared_prompt_gives_the_full_forwards_logprobs_and_gradient(policy) -> None:
    """k rows of one prompt: the prompt goes through the model once and its keys and values are
    repeated; log-probs and the gradient equal a forward over every row whole."""
    import dataclasses

    model, tok = policy
    ro = backend(policy, max_new_tokens=10, temperature=1.5).generate(PROMPTS, k=4, generator_seed=19)
    assert ro.group == 4 and ro.rows(slice(4, 12)).group == 4 and ro.rows(slice(2, 6)).group == 1
    whole = dataclasses.replace(ro, group=1)
    mask = ro.completion_mask.float()
    results = []
    model.train()
    try:
        for r in (ro, whole):
            model.zero_grad(set_to_none=True)
            logp, _ = completion_logprobs(model, r, temperature=0.9)
            (logp * mask * torch.linspace(-1, 1, logp.shape[0]).unsqueeze(1)).sum().backward()
            results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    (shared, g_shared), (full, g_full) = results
    m = ro.completion_mask.bool()
    torch.testing.assert_close(shared[m], full[m], rtol=1e-5, atol=1e-5)
    assert g_shared.keys() == g_full.keys()
    for name in g_full:
        torch.testing.assert_close(g_shared[name], g_full[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in g_full.values())


def test_nan_logits_fail_the_rollout_clearly_and_never_index_past_the_vocabulary(policy) -> None:
    import copy

    from worker.engine.errors import JobError
    from worker.engine.rollout.base import sample

    logits = torch.tensor([[float("nan")] * 6, [0.0, float("-inf"), 1.0, 2.0, float("nan"), 0.5]])
    assert (sample(logits, 1.0, 1.0, torch.tensor([0.3, 0.9])) < 6).all()  # a valid id, whatever the row holds
    model, tok = policy
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.norm.weight.fill_(float("nan"))  # diverged weights
    with pytest.raises(JobError) as exc:
        TransformersBackend(
            broken, tok, Sampling(max_new_tokens=4, temperature=1.0, top_p=1.0, max_prompt_length=64)
        ).generate(PROMPTS, k=2, generator_seed=0)
    assert exc.value.code == "non_finite_logits" and "learning_rate" in exc.value.message
