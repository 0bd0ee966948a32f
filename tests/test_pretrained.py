"""GPT-2 and Llama checkpoints loaded into the book's own modules give transformers' logits.

Each checkpoint is written here, with random weights, by `transformers`' own classes
(``save_pretrained``), then read back by `utils.pretrained`; both models see the same random
tokens and must agree to 1e-4. The weights are drawn with a large ``initializer_range`` so that
the logits are of order 1 and agreement means something. Nothing is downloaded.
"""

from __future__ import annotations

import functools
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from utils.attention import keep_attention_weights  # noqa: E402
from utils.checkpoint_models import CheckpointLM, GELUFeedForward  # noqa: E402
from utils.decoding import generate  # noqa: E402
from utils.pretrained import load_gpt2, load_llama  # noqa: E402


@functools.cache
def _transformers():
    """The reference library, imported when a test first needs it (not while each worker
    collects the tests: over a second); a test without it is skipped."""
    lib = pytest.importorskip("transformers")
    lib.logging.set_verbosity_error()
    return lib


VOCAB = 101  # not a multiple of 64
NEVER = 10_000  # an end token no model can produce: every generation runs its full length

GPT2_CONFIGS = {
    "d32-h2-tied": dict(n_embd=32, n_head=2),
    "d48-h4-untied": dict(n_embd=48, n_head=4, tie_word_embeddings=False),
    "d32-h4-inner40-exact-gelu": dict(n_embd=32, n_head=4, n_inner=40, activation_function="gelu"),
}
LLAMA_CONFIGS = {
    "grouped-query": dict(num_attention_heads=4, num_key_value_heads=2),
    "multi-head-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "multi-query": dict(num_attention_heads=4, num_key_value_heads=1),
    "d48-h6-kv3-biases": dict(
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=3,
        attention_bias=True,
        mlp_bias=True,
    ),
    # heads of 16 features on d = 32: W_Q is (64, 32), W_O (32, 64), as the reference reads it
    "d32-h4-heads-of-16": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}


def _gpt2(**overrides):
    settings = dict(
        vocab_size=VOCAB, n_positions=40, n_layer=2, initializer_range=0.3, bos_token_id=0
    )
    settings.update(eos_token_id=0, **overrides)
    lib = _transformers()
    return lib.GPT2LMHeadModel(lib.GPT2Config(**settings))


def _llama(**overrides):
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=2,
        max_position_embeddings=40,
        initializer_range=0.3,
        rope_theta=500.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    settings.update(overrides)
    lib = _transformers()
    return lib.LlamaForCausalLM(lib.LlamaConfig(**settings))


def _save(model, directory):
    """Write ``model`` in the Hugging Face layout; return it in eval mode, never to stop early."""
    model.save_pretrained(directory, safe_serialization=True)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one thread is faster, and far faster on a busy machine, where a
    second thread waits for a core at every small operation. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (directory, transformers model)} for every configuration above."""
    torch.manual_seed(0)
    made = {}
    for family, configs, make in (("gpt2", GPT2_CONFIGS, _gpt2), ("llama", LLAMA_CONFIGS, _llama)):
        for name, overrides in configs.items():
            directory = tmp_path_factory.mktemp(f"{family}-{name}")
            made[f"{family}/{name}"] = (directory, _save(make(**overrides), directory))
    return made


def _load(name, directory, **kw):
    return load_gpt2(directory, **kw) if name.startswith("gpt2") else load_llama(directory, **kw)


def _assert_same_logits(hf, ours, tokens):
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == (*tokens.shape, VOCAB)
    assert expected.abs().max() > 1.0  # logits of order 1: equality is not trivial
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", [f"gpt2/{n}" for n in GPT2_CONFIGS])
def test_gpt2_logits_equal_transformers(checkpoints, name):
    directory, hf = checkpoints[name]
    ours = load_gpt2(directory)
    assert isinstance(ours, CheckpointLM) and not ours.training
    assert all(isinstance(block.ff, GELUFeedForward) for block in ours.blocks)
    assert (ours.head.weight is ours.embed.weight) == hf.config.tie_word_embeddings
    tokens = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
    _assert_same_logits(hf, ours, tokens)


@pytest.mark.parametrize("name", [f"llama/{n}" for n in LLAMA_CONFIGS])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_llama_logits_equal_transformers(checkpoints, name, layout):
    directory, hf = checkpoints[name]
    ours = load_llama(directory, layout=layout)
    attn = ours.blocks[0].attn
    assert attn.num_kv_heads == hf.config.num_key_value_heads and attn.layout == layout
    assert (ours.head.weight is ours.embed.weight) == hf.config.tie_word_embeddings
    tokens = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    _assert_same_logits(hf, ours, tokens)
    # the from-scratch attention path (kept weights, for plots) gives the same logits
    _assert_same_logits(hf, keep_attention_weights(ours), tokens)
    assert attn.attn_weights.shape == (2, attn.num_heads, 13, 13)


def test_the_tanh_gelu_and_rope_base_matter(checkpoints):
    """Controls: the loaders' details are needed, the tests above would see them missing."""
    directory, hf = checkpoints["gpt2/d32-h2-tied"]
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    ours = load_gpt2(directory)
    for block in ours.blocks:
        block.ff.approximate = "none"  # the exact GELU in place of GPT-2's tanh form
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() > 1e-4
    directory, hf = checkpoints["llama/grouped-query"]
    ours = load_llama(directory)
    for block in ours.blocks:
        block.attn.base = 10000.0  # Llama's usual base, not this config's rope_theta
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() > 1e-3


def test_a_slightly_wrong_setting_fails_the_logit_check_with_and_without_cache(checkpoints):
    """The logits are the test (chapter 14): a RoPE base 1% off or an RMSNorm epsilon ten times
    too small moves them above the tolerance, through the cache as in one full pass."""
    directory, hf = checkpoints["llama/grouped-query"]
    ours = load_llama(directory)
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(tokens).logits
    for attr, value in (("base", 1.01), ("eps", 0.1)):
        if attr == "base":
            modules = [block.attn for block in ours.blocks]
        else:
            modules = [m for m in ours.modules() if type(m).__name__ == "RMSNorm"]
        before = [getattr(m, attr) for m in modules]
        for m in modules:
            setattr(m, attr, getattr(m, attr) * value)
        cache = ours.new_cache()
        with torch.no_grad():
            full = ours(tokens)
            steps = [ours(tokens[:, :4], cache=cache), ours(tokens[:, 4:], cache=cache)]
            cached = torch.cat(steps, dim=1)
        assert (full - expected).abs().max() > 1e-4, attr
        assert (cached - expected).abs().max() > 1e-4, attr
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)
        for m, b in zip(modules, before, strict=True):
            setattr(m, attr, b)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["gpt2/d48-h4-untied", "llama/grouped-query", "llama/multi-query"])
def test_greedy_generation_equals_transformers_with_and_without_cache(checkpoints, name):
    directory, hf = checkpoints[name]
    ours = _load(name, directory)
    prompts = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf.generate(
            prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=10
        )[:, 5:].tolist()
    cached = generate(ours, prompts, 10, eos=NEVER, use_cache=True)
    assert cached == expected
    assert generate(ours, prompts, 10, eos=NEVER, use_cache=False) == expected


def test_ragged_batch_with_as_many_rows_as_heads_decodes_each_row_right(checkpoints):
    """Prompts of different lengths share a padded batch; with the cache every row's new token
    is rotated at its own position, a (B, L) = (B, 1) positions tensor. With B == h those
    positions were once paired with the heads instead; each row must match its prompt alone."""
    directory, hf = checkpoints["llama/multi-head-tied"]
    ours = load_llama(directory)
    assert ours.blocks[0].attn.num_heads == ours.blocks[0].attn.num_kv_heads == 4
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 7, 5, 1)]
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8)
            expected.append(out[0, len(p) :].tolist())
    assert generate(ours, prompts, 8, eos=NEVER, use_cache=True) == expected
    assert generate(ours, prompts, 8, eos=NEVER, use_cache=False) == expected


def test_old_gpt2_file_layout_loads_the_same(checkpoints, tmp_path):
    """The original GPT-2 files name tensors without 'transformer.' and store each layer's
    causal-mask buffers (attn.bias, attn.masked_bias); both are understood."""
    directory, hf = checkpoints["gpt2/d32-h2-tied"]
    tensors = load_file(directory / "model.safetensors")
    old = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    for i in range(2):
        old[f"h.{i}.attn.bias"] = torch.ones(1, 1, 40, 40).tril()
        old[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(old, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    _assert_same_logits(hf, load_gpt2(tmp_path), tokens)


def test_dtype_float64(checkpoints):
    directory, hf = checkpoints["llama/multi-query"]
    ours = load_llama(directory, dtype=torch.float64)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = ours(tokens)
        expected = hf(tokens).logits
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.float(), expected, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- errors


def _copy_checkpoint(source, target, edit_tensors=None, edit_config=None):
    """Write a modified copy of the checkpoint in ``source`` to ``target``."""
    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, target / "model.safetensors")
    (target / "config.json").write_text(json.dumps(config))
    return target


def _shrink(key):
    def edit(t):
        t[key] = t[key][:-1].clone()

    return edit


def _set(field, value):
    def edit(c):
        c[field] = value

    return edit


def _old_rope(scaling):
    """The config as transformers 4 wrote it: rope_theta at the top, rope_scaling beside it."""

    def edit(c):
        c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
        c["rope_scaling"] = scaling

    return edit


def _update(mapping):
    return lambda t: t.update(mapping)


TENSOR_ERRORS = [
    (
        "gpt2/d32-h2-tied",
        _update({"transformer.h.0.attn.extra": torch.zeros(3)}),
        r"unknown key.*transformer\.h\.0\.attn\.extra",
    ),
    (
        "gpt2/d32-h2-tied",
        lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"),
        r"lacks 1 key.*transformer\.h\.1\.mlp\.c_fc\.bias",
    ),
    (
        "gpt2/d32-h2-tied",
        _shrink("transformer.h.0.attn.c_attn.weight"),
        r"transformer\.h\.0\.attn\.c_attn\.weight has shape \(31, 96\), expected \(32, 96\)",
    ),
    (
        "gpt2/d32-h2-tied",
        _update({"lm_head.weight": torch.zeros(VOCAB, 32)}),
        r"lm_head\.weight differs from transformer\.wte\.weight.*tie_word_embeddings",
    ),
    (
        "llama/grouped-query",
        _update({"model.layers.1.self_attn.rotary.weight": torch.zeros(2)}),
        r"unknown key.*model\.layers\.1\.self_attn\.rotary\.weight",
    ),
    (
        "llama/grouped-query",
        lambda t: t.pop("lm_head.weight"),
        r"lacks 1 key.*'lm_head\.weight'",
    ),
    (
        "llama/grouped-query",
        _shrink("model.layers.0.self_attn.k_proj.weight"),
        r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \(15, 32\), expected \(16, 32\)",
    ),
]


@pytest.mark.parametrize("name, edit, message", TENSOR_ERRORS)
def test_checkpoint_that_does_not_fit_is_refused_naming_the_key(
    checkpoints, tmp_path, name, edit, message
):
    directory = _copy_checkpoint(checkpoints[name][0], tmp_path, edit_tensors=edit)
    with pytest.raises(ValueError, match=message):
        _load(name, directory)


CONFIG_ERRORS = [
    ("gpt2/d32-h2-tied", _set("activation_function", "relu"), r"activation_function='relu'"),
    ("gpt2/d32-h2-tied", _set("scale_attn_by_inverse_layer_idx", True), r"inverse_layer_idx"),
    ("gpt2/d32-h2-tied", _set("model_type", "llama"), r"model_type='llama'.*'gpt2'"),
    ("gpt2/d32-h2-tied", lambda c: c.pop("n_head"), r"no 'n_head'"),
    (
        "llama/grouped-query",
        _set("rope_parameters", {"rope_type": "yarn", "rope_theta": 500.0, "factor": 8.0}),
        r"rope_type='yarn'",
    ),
    (
        "llama/grouped-query",
        _set("rope_parameters", {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0}),
        r"rope_type='llama3' lacks 'low_freq_factor'",
    ),
    (
        "llama/grouped-query",
        _old_rope({"type": "linear", "factor": -2.0}),
        r"rope_scaling\['factor'\] must be a positive number, got -2\.0",
    ),
    ("llama/grouped-query", _set("hidden_act", "gelu"), r"hidden_act='gelu'"),
    (
        "llama/grouped-query",
        _set("head_dim", 16),
        r"num_attention_heads=4 and heads of 16 = head_dim, so 64 rows in "
        r"model\.layers\.0\.self_attn\.q_proj\.weight, but it has 32",
    ),
    ("llama/grouped-query", _set("num_key_value_heads", 3), r"num_key_value_heads=3"),
]


@pytest.mark.parametrize("name, edit, message", CONFIG_ERRORS)
def test_unsupported_config_is_refused_naming_the_field(checkpoints, tmp_path, name, edit, message):
    directory = _copy_checkpoint(checkpoints[name][0], tmp_path, edit_config=edit)
    with pytest.raises(ValueError, match=message):
        _load(name, directory)


def test_older_llama_config_spelling(checkpoints, tmp_path):
    """Configs written before transformers 5 keep rope_theta at the top level."""
    source, hf = checkpoints["llama/grouped-query"]
    directory = _copy_checkpoint(source, tmp_path, edit_config=_old_rope(None))
    assert "rope_parameters" not in json.loads((directory / "config.json").read_text())
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(8))
    _assert_same_logits(hf, load_llama(directory), tokens)  # rope_theta=500 was read


def test_missing_files_and_bad_arguments(checkpoints, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_gpt2(tmp_path)
    directory = checkpoints["llama/multi-query"][0]
    with pytest.raises(ValueError, match="layout"):
        load_llama(directory, layout="rotate")
    with pytest.raises(ValueError, match="floating"):
        load_llama(directory, dtype=torch.int64)


def test_model_input_errors_name_what_was_expected(checkpoints):
    gpt2 = load_gpt2(checkpoints["gpt2/d32-h2-tied"][0])
    llama = load_llama(checkpoints["llama/multi-query"][0])
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 101\), got ids from 0 to 101"):
        gpt2(torch.tensor([[0, 101]]))
    with pytest.raises(ValueError, match=r"\(1, 41\) is longer than max_len=40"):
        gpt2(torch.zeros(1, 41, dtype=torch.long))  # Llama runs on (test_checkpoint_files.py)
    with pytest.raises(ValueError, match="positions are only taken together with a cache"):
        llama(torch.zeros(1, 3, dtype=torch.long), positions=torch.arange(3))
    with pytest.raises(ValueError, match=r"positions must have shape \(L,\) = \(3,\)"):
        llama(
            torch.zeros(2, 3, dtype=torch.long), cache=llama.new_cache(), positions=torch.arange(4)
        )
    attn = llama.blocks[0].attn
    with pytest.raises(
        ValueError, match=r"x must have shape \(B, L, d_model=32\), got \(2, 3, 16\)"
    ):
        attn(torch.zeros(2, 3, 16))
    ff = gpt2.blocks[0].ff
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., d_model=32\), got \(2, 8\)"):
        ff(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="approximate"):
        GELUFeedForward(8, 16, approximate="sigmoid")


def test_cached_chunks_give_the_logits_of_the_whole_sequence(checkpoints):
    """Feeding a sequence in pieces through the cache gives the rows of one full call."""
    for name in ("gpt2/d48-h4-untied", "llama/grouped-query"):
        ours = _load(name, checkpoints[name][0])
        tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))
        cache = ours.new_cache()
        with torch.no_grad():
            full = ours(tokens)
            pieces = [ours(tokens[:, a:b], cache=cache) for a, b in ((0, 5), (5, 6), (6, 12))]
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)
        assert cache.length == 12
