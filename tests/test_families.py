"""Mistral, Qwen2, Qwen3 and Gemma checkpoints loaded into the book's parts give transformers'
logits (`utils.families`).

Each checkpoint is written here by `transformers`' own classes (``save_pretrained``), tiny,
seeded, float32, with every norm gain and bias drawn at random (transformers starts them at
one or zero, where a loader that forgot them would still agree). Then, for every family:
logits against the reference to 1e-4 at batch 1 and at a left-padded batch of 3 (the padding
mask and positions as transformers computes them for padding); the cached path, a prompt and
then one token at a time, equal to a full forward; greedy tokens of `utils.decoding.generate`
equal to transformers' ``generate`` on a ragged batch; a config that does not fit, or an
option the book does not implement, refused naming the field. Controls show each family's own
piece matters: without the window, the (1 + w) gain, the sqrt(d) scale, the tanh GELU, the
biases or the q/k norms, the logits move past the tolerance. Windows are shorter than the
sequences (4 positions, prompts of up to 12 and 8 more tokens), or the tests could not fail.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import test_pretrained
import torch
from safetensors.torch import load_file, save_file
from test_pretrained import NEVER, VOCAB, _save

import utils.decoding as decoding
import utils.decoding_plan as decoding_plan
from utils.checkpoint_models import RotarySelfAttention
from utils.decoding import generate
from utils.decoding_plan import plan_for
from utils.families import (
    FAMILY_CHANGES,
    load_checkpoint,
    load_gemma,
    load_mistral,
    load_qwen2,
    load_qwen3,
)
from utils.family_parts import FamilyAttention, OffsetRMSNorm
from utils.kv_cache import KVCache
from utils.layers import RMSNorm
from utils.masks import local_mask

one_thread = test_pretrained.one_thread  # an autouse fixture: tiny models, one thread

TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.3,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
WINDOW = 4
# name -> (transformers class prefix, config overrides, our loader)
FAMILIES = {
    "mistral/window": ("Mistral", dict(sliding_window=WINDOW), load_mistral),
    "mistral/no-window": ("Mistral", dict(sliding_window=None, rope_theta=500.0), load_mistral),
    "qwen2/biases": ("Qwen2", dict(tie_word_embeddings=True), load_qwen2),
    "qwen2/window-on-layer-1": (
        "Qwen2",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        load_qwen2,
    ),
    "qwen3/heads-of-16": ("Qwen3", dict(head_dim=16), load_qwen3),
    "qwen3/bias-window": (
        "Qwen3",
        dict(
            head_dim=8,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=0,
        ),
        load_qwen3,
    ),
    "gemma/heads-of-16": ("Gemma", dict(head_dim=16, num_key_value_heads=1), load_gemma),
}


def _make(prefix, overrides):
    lib = test_pretrained._transformers()
    config = getattr(lib, f"{prefix}Config")(**(TINY | overrides))
    model = getattr(lib, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():  # gains and biases away from transformers' ones and zeros
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{name: (folder, transformers model in eval mode)} for every entry of FAMILIES."""
    torch.manual_seed(0)
    out = {}
    for name, (prefix, overrides, _) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(name.replace("/", "-"))
        out[name] = (folder, _save(_make(prefix, overrides), folder))
    return out


def _load(name, folder, **kw):
    return FAMILIES[name][2](folder, **kw)


def _rows(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _left_padded(rows):
    """tokens (B, W), mask (B, W) True at real tokens, positions (B, W) as transformers
    computes them for left padding (cumsum of the mask - 1, padding at 1)."""
    width = max(map(len, rows))
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        tokens[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = True
    positions = (mask.long().cumsum(1) - 1).masked_fill(~mask, 1)
    return tokens, mask, positions


def _hf(hf, tokens, mask=None, positions=None):
    with torch.no_grad():
        if mask is None:
            return hf(tokens).logits
        return hf(input_ids=tokens, attention_mask=mask.long(), position_ids=positions).logits


def _ours_padded(ours, tokens, mask, positions):
    """A full forward of a padded batch: through a fresh cache, which takes positions."""
    with torch.no_grad():
        return ours(tokens, mask, cache=ours.new_cache(), positions=positions)


def _worst(got, expected, mask=None):
    diff = (got - expected).abs()
    return float((diff if mask is None else diff[mask]).max())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_equal_transformers_at_batch_1_and_a_padded_batch_of_3(made, name):
    folder, hf = made[name]
    ours = _load(name, folder)
    assert ours.family == name.split("/")[0] and not ours.training
    assert (ours.head.weight is ours.embed.weight) == hf.config.tie_word_embeddings
    (row,) = _rows([12], seed=1)
    tokens = torch.tensor([row])
    expected = _hf(hf, tokens)
    assert expected.abs().max() > 1.0  # logits of order 1: agreement means something
    with torch.no_grad():
        assert _worst(ours(tokens), expected) < 1e-4
    tokens, mask, positions = _left_padded(_rows([12, 9, 5], seed=2))
    expected = _hf(hf, tokens, mask, positions)
    got = _ours_padded(ours, tokens, mask, positions)
    assert _worst(got, expected, mask) < 1e-4  # real positions only: padding's are garbage


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_cached_path_equals_a_full_forward(made, name):
    """A prompt, then 8 tokens one at a time through the cache: the logits of one full
    forward (and of the reference), at batch 1 and at a left-padded batch of 3."""
    folder, hf = made[name]
    ours = _load(name, folder)
    for lengths in ([12], [12, 9, 5]):
        rows = _rows([n + 8 for n in lengths], seed=3)
        tokens, mask, positions = _left_padded(rows)
        full = _ours_padded(ours, tokens, mask, positions)
        assert _worst(full, _hf(hf, tokens, mask, positions), mask) < 1e-4
        width = tokens.shape[1] - 8
        cache = ours.new_cache()
        with torch.no_grad():
            steps = [ours(tokens[:, :width], mask[:, :width], cache=cache,
                          positions=positions[:, :width])]
            for t in range(width, width + 8):
                steps.append(ours(tokens[:, t : t + 1], mask[:, : t + 1], cache=cache,
                                  positions=positions[:, t : t + 1]))
        cached = torch.cat(steps, dim=1)
        assert _worst(cached, full, mask) < 1e-4  # summation orders differ: about 1e-5
        assert cache.length == tokens.shape[1]


def _expected_tokens(hf, prompts, new_tokens):
    """transformers' greedy continuation of each prompt alone."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            full = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=new_tokens)
            out.append(full[0, len(p) :].tolist())
    return out


def _planned(model):
    cache = model.new_cache().reserve(8)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
    return plan_for(model, cache) is not None


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_equals_transformers_on_a_ragged_batch(made, name):
    """Ragged prompts share one batch in `generate`: a shorter row's new tokens sit in the
    cache after slots of padding, so a window must count positions, not slots; with the cache
    the steps after the prompts run through the fast path (`utils.decoding_plan`), which must
    apply the window, the q/k norms and Gemma's pieces too."""
    folder, hf = made[name]
    ours = _load(name, folder)
    prompts = _rows([12, 7, 5], seed=4)
    expected = _expected_tokens(hf, prompts, 8)
    assert generate(ours, prompts, 8, eos=NEVER) == expected
    assert generate(ours, prompts, 8, eos=NEVER, use_cache=False) == expected
    assert generate(ours, prompts[1:2], 8, eos=NEVER) == expected[1:2]
    assert _planned(ours)  # the steps after the prompts ran through utils.decoding_plan


def test_a_window_by_slots_or_none_would_fail_the_ragged_batch(made, monkeypatch):
    """Controls: counted in cache slots (right only without a gap of padding), the window of
    the checked path gives other tokens for the short rows of a ragged batch; the fast path
    without the window gives other tokens too. The test above would see either."""
    folder, hf = made["mistral/window"]
    ours = _load("mistral/window", folder)
    prompts = _rows([12, 7, 5], seed=4)
    expected = _expected_tokens(hf, prompts, 8)

    def slots(self, l_k, length, cache, positions):
        return torch.arange(l_k)[None]

    with monkeypatch.context() as m:
        m.setattr(FamilyAttention, "key_positions", slots)
        m.setattr(decoding, "plan_for", lambda *a: None)  # the checked path, through the cache
        got = generate(ours, prompts, 8, eos=NEVER)
    assert got[0] == expected[0] and got[1:] != expected[1:]
    init = decoding_plan._Layer.__init__

    def windowless(self, *args):
        init(self, *args)
        self.window = None

    with monkeypatch.context() as m:
        m.setattr(decoding_plan._Layer, "__init__", windowless)
        assert generate(ours, prompts, 8, eos=NEVER) != expected


def _moved(hf, ours, tokens):
    with torch.no_grad():
        return _worst(ours(tokens), hf(tokens).logits)


def test_each_family_piece_matters(made):
    """Controls: drop a family's piece and the logits move past the tolerance."""
    tokens = torch.tensor(_rows([12], seed=5))
    folder, hf = made["mistral/window"]
    ours = load_mistral(folder)
    for block in ours.blocks:
        block.attn.window = None
    assert _moved(hf, ours, tokens) > 1e-3
    folder, hf = made["qwen2/biases"]
    ours = load_qwen2(folder)
    for block in ours.blocks:
        block.attn.w_q.bias.data.zero_()
    assert _moved(hf, ours, tokens) > 1e-3
    folder, hf = made["qwen3/heads-of-16"]
    ours = load_qwen3(folder)
    for block in ours.blocks:
        block.attn.q_norm = block.attn.k_norm = None
    assert _moved(hf, ours, tokens) > 1e-3
    folder, hf = made["gemma/heads-of-16"]
    for edit in ("gain w", "no scale", "exact gelu"):
        ours = load_gemma(folder)
        assert _moved(hf, ours, tokens) < 1e-4
        for m in ours.modules():
            if edit == "gain w" and isinstance(m, OffsetRMSNorm):
                m.compute = RMSNorm.compute.__get__(m)  # x / rms * w, not * (1 + w)
            if edit == "no scale" and hasattr(m, "scale"):
                m.scale = 1.0
            if edit == "exact gelu" and hasattr(m, "approximate"):
                m.approximate = "none"
        assert _moved(hf, ours, tokens) > 1e-4, edit


def test_the_pieces_are_those_of_the_family(made):
    mistral = load_mistral(made["mistral/window"][0])
    assert all(b.attn.window == WINDOW for b in mistral.blocks)
    plain = load_mistral(made["mistral/no-window"][0])
    assert all(type(b.attn) is RotarySelfAttention for b in plain.blocks)
    qwen2 = load_qwen2(made["qwen2/window-on-layer-1"][0])
    assert type(qwen2.blocks[0].attn) is RotarySelfAttention
    assert qwen2.blocks[1].attn.window == WINDOW
    attn = qwen2.blocks[0].attn
    assert attn.w_q.bias is not None and attn.w_o.bias is None
    qwen3 = load_qwen3(made["qwen3/heads-of-16"][0])
    attn = qwen3.blocks[0].attn
    assert attn.d_k == 16 and attn.w_q.weight.shape == (64, 32)
    assert attn.w_o.weight.shape == (32, 64)
    assert attn.q_norm.weight.shape == (16,) and attn.window is None
    gemma = load_gemma(made["gemma/heads-of-16"][0])
    assert isinstance(gemma.norm, OffsetRMSNorm) and gemma.head.weight is gemma.embed.weight


def test_interleaved_layout_float64_meta_and_shards(made, tmp_path):
    """What load_llama does, the families do through the same path: the other RoPE layout
    (W_Q, W_K and Qwen3's q/k gains permuted), float64, the meta device, sharded files."""
    tokens = torch.tensor(_rows([12], seed=6))
    for name in ("qwen3/bias-window", "gemma/heads-of-16", "mistral/window"):
        folder, hf = made[name]
        assert _moved(hf, _load(name, folder, layout="interleaved"), tokens) < 1e-4
        ours = _load(name, folder, dtype=torch.float64)
        with torch.no_grad():
            assert ours(tokens).dtype == torch.float64
        assert _moved(hf.double(), ours, tokens) < 1e-4
        hf.float()
        assert all(p.is_meta for p in _load(name, folder, device="meta").parameters())
    folder, hf = made["qwen3/heads-of-16"]
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert _moved(hf, load_qwen3(tmp_path), tokens) < 1e-4


def _edited(source, target, **fields):
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(fields)
    (target / "config.json").write_text(json.dumps(config))
    return target


BAD_CONFIGS = [
    (
        "mistral/window",
        {"num_attention_heads": 2},
        r"num_attention_heads=2 and heads of 8 = head_dim, so 16 rows in "
        r"model\.layers\.0\.self_attn\.q_proj\.weight, but it has 32",
    ),
    ("mistral/window", {"sliding_window": 0}, r"'sliding_window' must be a positive int"),
    ("mistral/window", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ("qwen2/biases", {"num_key_value_heads": 3}, r"num_key_value_heads=3"),
    (
        "qwen2/biases",
        {"layer_types": ["full_attention", "sliding_attention"]},
        r"layer_types has 'sliding_attention' layers but use_sliding_window is false",
    ),
    ("qwen2/biases", {"layer_types": ["full_attention"]}, r"'layer_types' must list 2"),
    ("qwen3/heads-of-16", {"head_dim": 8}, r"heads of 8 = head_dim, so 32 rows"),
    (
        "qwen3/heads-of-16",
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
        r"rope_type='yarn'",
    ),
    ("gemma/heads-of-16", {"use_bidirectional_attention": True}, r"use_bidirectional_attention"),
    ("gemma/heads-of-16", {"hidden_act": "relu"}, r"hidden_act='relu'"),
    ("gemma/heads-of-16", {"model_type": "llama"}, r"model_type='llama'; expected 'gemma'"),
]


@pytest.mark.parametrize("name, fields, message", BAD_CONFIGS)
def test_a_bad_config_is_refused_naming_the_field(made, tmp_path, name, fields, message):
    folder = _edited(made[name][0], tmp_path / "c", **fields)
    with pytest.raises(ValueError, match=message):
        _load(name, folder)
    with pytest.raises(ValueError, match=message):  # from the headers alone
        _load(name, folder, device="meta")


def test_qwen3_norms_of_another_width_name_head_dim(made, tmp_path):
    """A q_norm whose width is not head_dim, W_Q fitting: the field is named."""
    folder = _edited(made["qwen3/heads-of-16"][0], tmp_path / "c")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"head_dim=16, but the tensors hold 8 entries in "
                                         r"model\.layers\.0\.self_attn\.q_norm\.weight"):
        load_qwen3(folder)


def test_load_checkpoint_dispatches_on_model_type(made, tmp_path):
    torch.manual_seed(1)
    for family, model in (
        ("gpt2", test_pretrained._gpt2(n_embd=32, n_head=2)),
        ("llama", test_pretrained._llama(num_attention_heads=4, num_key_value_heads=2)),
    ):
        _save(model, tmp_path / family)
        assert load_checkpoint(tmp_path / family).family == family
    tokens = torch.tensor(_rows([9], seed=7))
    for name, (folder, hf) in made.items():
        ours = load_checkpoint(folder)
        assert ours.family == name.split("/")[0]
        assert _moved(hf, ours, tokens) < 1e-4
    folder = _edited(made["qwen2/biases"][0], tmp_path / "falcon", model_type="falcon")
    with pytest.raises(ValueError, match=r"model_type='falcon'; load_checkpoint reads \['gpt2', "
                                         r"'llama', 'mistral', 'qwen2', 'qwen3', 'gemma'\]"):
        load_checkpoint(folder)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path / "nowhere")


def test_family_changes_is_a_table_against_the_2017_transformer():
    columns = ["norm", "positions", "attention", "feed-forward", "embedding", "extends"]
    assert list(FAMILY_CHANGES) == [
        "transformer_2017", "gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma"
    ]
    for family, row in FAMILY_CHANGES.items():
        assert list(row) == columns, family
        assert all(isinstance(v, str) and 0 < len(v) <= 45 for v in row.values()), family
        assert row["extends"].startswith("chapter"), family


def test_the_window_is_chapter_4s_local_mask_and_needs_the_keys_positions():
    """FamilyAttention(window=w) is RotarySelfAttention under chapter 4's causal local mask of
    window w - 1; a cache it did not fill (no key positions) is refused, not misread."""
    torch.manual_seed(2)
    windowed = FamilyAttention(32, 4, 2, head_dim=16, window=3).eval()
    plain = RotarySelfAttention(32, 4, 2, head_dim=16).eval()
    plain.load_state_dict(windowed.state_dict())
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        got = windowed(x, torch.ones(9, 9, dtype=torch.bool).tril())
        torch.testing.assert_close(got, plain(x, local_mask(9, 2, causal=True)))
        assert (got - plain(x, torch.ones(9, 9, dtype=torch.bool).tril())).abs().max() > 1e-3
        plain_cache, ours_cache = KVCache(), KVCache()
        plain(x[:, :4], None, cache=plain_cache)  # keys without positions
        with pytest.raises(ValueError, match="the cache holds 4 keys but the positions of 0"):
            windowed(x[:, 4:5], None, cache=plain_cache, positions=torch.tensor([4]))
        windowed(x[:, :4], torch.ones(4, 4, dtype=torch.bool).tril(), cache=ours_cache)
        step = windowed(x[:, 4:5], None, cache=ours_cache, positions=torch.tensor([4]))
        torch.testing.assert_close(step, got[:, 4:5])
        assert ours_cache.positions.tolist() == [[0, 1, 2, 3, 4]]


def test_gemmas_pieces_round_as_the_reference_in_bfloat16(made):
    """In bfloat16 the embedding's factor sqrt(d) is rounded to the dtype before the product
    (sqrt(32) = 5.657 becomes 5.656), and the (1 + w) norm rounds only at the end: the very
    bits of the reference's modules, where the other orders differ."""
    folder, hf = made["gemma/heads-of-16"]
    ours = load_gemma(folder, dtype=torch.bfloat16)
    ref = copy.deepcopy(hf).to(torch.bfloat16)
    tokens = torch.tensor(_rows([12], seed=8))
    with torch.no_grad():
        got = ours.embed(tokens, torch.arange(12))
        assert torch.equal(got, ref.model.embed_tokens(tokens))
        unrounded = (ours.embed.weight[tokens].float() * 32**0.5).to(torch.bfloat16)
        assert not torch.equal(got, unrounded)
        x = torch.randn(3, 7, 32).to(torch.bfloat16)
        norm = ours.blocks[0].norm1
        assert torch.equal(norm(x), ref.model.layers[0].input_layernorm(x))
        h = x.float()
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)).to(torch.bfloat16)
        assert not torch.equal(norm(x), y * (1 + norm.weight))  # Llama's order: rounded first
