"""The checked-once decoding step (`utils.decoding_plan`): the same tokens as the checked modules
on every model family the library builds or loads, and the checks kept at the API's edge."""

from __future__ import annotations

import pytest
import test_families
import test_pretrained
import torch
from test_pretrained import GPT2_CONFIGS, LLAMA_CONFIGS, NEVER, VOCAB, checkpoints  # noqa: F401

import utils.decoding as decoding
from utils.decoding_plan import DecodePlan, plan_for
from utils.models import DecoderOnlyLM

one_thread = test_pretrained.one_thread  # an autouse fixture: tiny models, one thread


def _both(model, prompts, new_tokens, monkeypatch, seed=None, **kw):
    """generate's tokens with the plan (and how many steps it ran) and without it (the checked
    path); ``seed``: each run samples from a generator of its own seeded with it."""
    def gen():
        return {} if seed is None else {"generator": torch.Generator().manual_seed(seed)}

    steps = []
    real_step = DecodePlan.step

    def counted(self, *args):
        steps.append(1)
        return real_step(self, *args)

    with monkeypatch.context() as m:
        m.setattr(DecodePlan, "step", counted)
        planned = decoding.generate(model, prompts, new_tokens, **kw, **gen())
    with monkeypatch.context() as m:
        m.setattr(decoding, "plan_for", lambda *a: None)
        checked = decoding.generate(model, prompts, new_tokens, **kw, **gen())
    return planned, checked, len(steps)


def _book_models():
    torch.manual_seed(0)
    made = {}
    for name, kw in {"pre-LN, tied": {}, "post-LN": {"norm_first": False},
                     "untied": {"tie_output": False}, "relu": {"activation": "relu"}}.items():
        made[name] = DecoderOnlyLM(VOCAB, d_model=32, nhead=4, num_layers=2, max_len=64,
                                   **kw).eval()
    return made


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]  # ragged: padded, masked slots


@pytest.mark.parametrize("name", ["pre-LN, tied", "post-LN", "untied", "relu"])
def test_book_models_decode_the_same_tokens(name, monkeypatch):
    model = _book_models()[name]
    planned, checked, steps = _both(model, PROMPTS, 30, monkeypatch, eos=NEVER)
    assert steps == 29  # every step after the prompts' ran through the plan
    assert planned == checked and all(len(row) == 30 for row in planned)


@pytest.mark.parametrize("name", [f"gpt2/{n}" for n in GPT2_CONFIGS]
                         + [f"llama/{n}" for n in LLAMA_CONFIGS])
def test_loaded_checkpoints_decode_the_same_tokens(checkpoints, name, monkeypatch):  # noqa: F811
    directory, _ = checkpoints[name]
    model = test_pretrained._load(name, directory)
    planned, checked, steps = _both(model, PROMPTS, 25, monkeypatch, eos=NEVER)
    assert steps == 24
    assert planned == checked
    # sampling: the same draws from the same generator, a row finished early by <eos>
    kw = {"temperature": 1.5, "eos": planned[0][3]}
    for seed in range(2):
        planned_rows, checked_rows, _ = _both(model, PROMPTS, 25, monkeypatch, seed=seed, **kw)
        assert planned_rows == checked_rows


@pytest.mark.parametrize("name", list(test_families.FAMILIES))
def test_loaded_families_decode_the_same_tokens(name, tmp_path, monkeypatch):
    """Mistral, Qwen2, Qwen3 and Gemma (`utils.families`): the plan runs their windows (by
    position: PROMPTS is ragged), q/k norms and Gemma's pieces, to the checked path's tokens."""
    prefix, overrides, load = test_families.FAMILIES[name]
    torch.manual_seed(0)
    test_pretrained._save(test_families._make(prefix, overrides), tmp_path)
    model = load(tmp_path)
    planned, checked, steps = _both(model, PROMPTS, 25, monkeypatch, eos=NEVER)
    assert steps == 24
    assert planned == checked
    kw = {"temperature": 1.5, "eos": planned[0][3]}  # sampling, a row finished early
    planned_rows, checked_rows, _ = _both(model, PROMPTS, 25, monkeypatch, seed=0, **kw)
    assert planned_rows == checked_rows


def test_gpt2_keeps_its_fused_projection_without_a_copy(checkpoints):  # noqa: F811
    """load_gpt2 stores W_Q, W_K, W_V side by side, as the checkpoint's c_attn: the plan reads
    them as one product without copying them."""
    directory, _ = checkpoints["gpt2/d32-h2-tied"]
    model = test_pretrained._load("gpt2/d32-h2-tied", directory)
    cache = model.new_cache().reserve(8)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
    plan = plan_for(model.eval(), cache)
    attn = model.blocks[0].attn
    fused = plan.layers[0].w_qkv
    assert fused.untyped_storage().data_ptr() == attn.w_q.weight.untyped_storage().data_ptr()
    assert torch.equal(fused, torch.cat([attn.w_q.weight, attn.w_k.weight, attn.w_v.weight]))


def test_the_plan_is_refused_where_it_would_compute_something_else(monkeypatch):
    """A forward hook, a subclass, kept attention weights or a cache without room: the checked
    modules decode, and the tokens are theirs."""
    model = _book_models()["pre-LN, tied"]

    def cache_after_prompt(m, reserve=True):
        cache = m.new_cache()
        if reserve:
            cache.reserve(10)
        with torch.inference_mode():
            m(torch.tensor([[1, 2, 3]]), cache=cache)
        return cache

    assert isinstance(plan_for(model, cache_after_prompt(model)), DecodePlan)
    assert plan_for(model, cache_after_prompt(model, reserve=False)) is None
    handle = model.blocks.layers[0].ff.register_forward_hook(lambda *a: None)
    assert plan_for(model, cache_after_prompt(model)) is None
    handle.remove()
    model.blocks.layers[1].self_attn.keep_weights = True
    assert plan_for(model, cache_after_prompt(model)) is None
    model.blocks.layers[1].self_attn.keep_weights = False

    class Doubled(DecoderOnlyLM):
        def forward(self, *args, **kwargs):
            return 2 * super().forward(*args, **kwargs)

    doubled = Doubled(VOCAB, d_model=32, nhead=4, num_layers=2, max_len=64).eval()
    assert plan_for(doubled, cache_after_prompt(doubled)) is None
    planned, checked, steps = _both(doubled, PROMPTS, 5, monkeypatch, eos=NEVER)
    assert steps == 0 and planned == checked


def test_bad_scores_after_the_prompt_still_raise_through_the_plan(monkeypatch):
    """The plan skips the modules' checks, not the check of what the loop picks: a NaN that
    first appears at a later position raises next_token's error, as the checked path does."""
    model = _book_models()["pre-LN, tied"]
    model.embed.positions.pe[12] = float("nan")  # position 12: the 7th new token of row 0
    for plan in (True, False):
        with monkeypatch.context() as m:
            if not plan:
                m.setattr(decoding, "plan_for", lambda *a: None)
            with pytest.raises(ValueError, match="must not contain NaN or \\+inf"):
                decoding.generate(model, [PROMPTS[0]], 20, eos=NEVER)


def test_prompts_are_still_checked_at_the_edge():
    model = _book_models()["pre-LN, tied"]
    with pytest.raises(ValueError, match="ids"):
        decoding.generate(model, [[1, 2, VOCAB]], 3)  # an id past the vocabulary
    with pytest.raises(ValueError, match="max_len=64"):
        decoding.generate(model, [[1] * 60], 10)  # no room for 10 more


@pytest.mark.parametrize("scores, message", [
    ([0.0, float("nan"), 1.0], "NaN or \\+inf"),
    ([0.0, float("inf"), 1.0], "NaN or \\+inf"),
    ([-float("inf")] * 3, "all -inf"),
])
def test_greedy_pick_checks_the_picked_scores_only(scores, message):
    """next_token at temperature 0 reads the B picked scores, not all V: still every bad row."""
    logits = torch.tensor([[0.0, 1.0, 2.0], scores])
    with pytest.raises(ValueError, match=message):
        decoding.next_token(logits)
    ok = torch.tensor([[3e38, 3e38, -float("inf")], [1.0, 2.0, 0.0]])  # a sum that overflows
    assert decoding.next_token(ok).tolist() == [0, 1]


@pytest.mark.parametrize("name", ["gpt2/d32-h2-tied", "llama/grouped-query"])
def test_sampling_filters_decode_the_same_tokens_with_and_without_the_plan(
        checkpoints, name, monkeypatch):  # noqa: F811
    directory, _ = checkpoints[name]
    model = test_pretrained._load(name, directory)
    kw = dict(temperature=0.9, top_k=30, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    for seed in range(2):
        planned, checked, steps = _both(model, PROMPTS, 25, monkeypatch, seed=seed, eos=NEVER,
                                        **kw)
        assert steps == 24
        assert planned == checked, f"seed {seed}: the plan changed the sampled tokens"
    planned, checked, _ = _both(model, PROMPTS, 25, monkeypatch, eos=NEVER,
                                repetition_penalty=1.5)  # greedy with a penalty
    assert planned == checked
