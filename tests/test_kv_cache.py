"""Tests for the key/value cache: incremental decoding gives what recomputing the prefix gives."""

import pytest
import torch

from utils import seed_everything
from utils.attention import GroupedQueryAttention, MultiHeadAttention
from utils.costs import kv_cache_bytes
from utils.data import BOS, EOS, PAD
from utils.decoding import generate, greedy_decode, sample_decode
from utils.kv_cache import DecoderCache, KVCache
from utils.models import DecoderOnlyLM, Seq2SeqTransformer

V = 13


def _lm(seed, norm_first=True, dtype=torch.float32, **kw):
    seed_everything(seed)
    kw = dict(dict(d_model=16, nhead=4, num_layers=2, max_len=40), **kw)
    return DecoderOnlyLM(V, norm_first=norm_first, **kw).to(dtype).eval()


def _s2s(seed, norm_first=False, dtype=torch.float32):
    seed_everything(seed)
    return Seq2SeqTransformer(V, V, d_model=16, nhead=2, num_encoder_layers=2,
                              num_decoder_layers=2, norm_first=norm_first,
                              max_len=30).to(dtype).eval()


def _prompts(seed, batch, ragged):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (batch,), generator=g) if ragged else [5] * batch
    return [[BOS] + torch.randint(3, V, (int(n),), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lm_step_logits_match_full_forward(seed, norm_first, dtype):
    """Feeding a prompt, then one token at a time, gives the full forward pass's logits."""
    model = _lm(seed, norm_first, dtype)
    tokens = torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache()
        steps = [model(tokens[:, :5], cache=cache)]
        steps += [model(tokens[:, t:t + 1], cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.length == 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm_first", [True, False])
def test_seq2seq_step_logits_match_full_decode(norm_first, dtype):
    model = _s2s(3, norm_first, dtype)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, V, (2, 7), generator=g)
    src[1, 4:] = PAD
    src_mask = src != PAD
    tgt = torch.randint(3, V, (2, 9), generator=g)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        full = model.decode(tgt, memory, src_mask)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, t:t + 1], memory, src_mask, cache=cache) for t in range(9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    # the memory's keys and values were computed once: L_s positions, whatever the steps
    assert all(c.static and c.length == 7 for c in cache.cross_attn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("batch,ragged", [(1, False), (4, False), (5, True)])
def test_generate_same_tokens_with_and_without_cache(seed, norm_first, dtype, batch, ragged):
    model = _lm(seed, norm_first, dtype)
    prompts = _prompts(seed, batch, ragged)
    cached = generate(model, prompts, 20)
    assert cached == generate(model, prompts, 20, use_cache=False)
    # sampling draws the same random numbers both ways
    runs = [generate(model, prompts, 20, temperature=1.0, use_cache=c,
                     generator=torch.Generator().manual_seed(seed)) for c in (True, False)]
    assert runs[0] == runs[1]


def test_generate_eos_stopping_is_the_same_with_and_without_cache():
    """A model whose <eos> score is raised stops early in some rows, the same way both ways."""
    lengths = []
    for seed in (0, 2):
        model = _lm(seed, num_layers=1)
        with torch.no_grad():
            model.head.bias[EOS] += 2.5
        prompts = _prompts(seed, 6, ragged=True)
        out = generate(model, prompts, 15)
        assert out == generate(model, prompts, 15, use_cache=False)
        lengths += [len(o) for o in out]
        runs = [generate(model, prompts, 15, temperature=1.0, use_cache=c,
                         generator=torch.Generator().manual_seed(seed)) for c in (True, False)]
        assert runs[0] == runs[1]
    # rows that stop at once, after a few tokens, and never
    assert 0 in lengths and 15 in lengths and any(0 < n < 15 for n in lengths)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_and_sample_decode_same_tokens_with_and_without_cache(seed, norm_first):
    model = _s2s(seed, norm_first)
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (4, 8), generator=g)
    src[1, 3:] = PAD
    src[3, 6:] = PAD
    mask = src != PAD
    out = greedy_decode(model, src, mask, max_len=25)
    assert out == greedy_decode(model, src, mask, max_len=25, use_cache=False)
    a, b = (sample_decode(model, src, mask, 25, 1.5, torch.Generator().manual_seed(seed),
                          use_cache=c) for c in (True, False))
    assert a == b


def test_gqa_cache_stores_kv_heads_and_matches_full_attention():
    seed_everything(0)
    gqa = GroupedQueryAttention(32, num_heads=8, num_kv_heads=2).eval()
    x = torch.randn(3, 10, 32)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    full = gqa(x, x, x, causal[None])
    cache = KVCache()
    steps = [gqa(x[:, :4], x[:, :4], x[:, :4], causal[None, :4, :4], cache=cache)]
    steps += [gqa(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], cache=cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-6, rtol=0)
    assert cache.k.shape == (3, 2, 10, 4)  # h_kv = 2 heads, not 8
    assert cache.nbytes == 2 * 3 * 2 * 10 * 4 * 4
    # the same weights as multi-head attention: a 4x larger cache
    mha_cache = KVCache()
    mha = MultiHeadAttention(32, 8)
    mha(x, x, x, causal[None], cache=mha_cache)
    assert mha_cache.nbytes == 4 * cache.nbytes


@pytest.mark.parametrize("dtype,size", [(torch.float32, 4), (torch.float64, 8)])
def test_cache_shapes_and_memory_formula(dtype, size):
    model = _lm(0, dtype=dtype, num_layers=3)
    cache = model.new_cache()
    tokens = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        model(tokens, cache=cache)
        model(tokens[:, :1], cache=cache)
    h, d_k = 4, 16 // 4
    for c in cache.self_attn:
        assert c.k.shape == c.v.shape == (2, h, 8, d_k)
        assert c.k.dtype == dtype
    expected = 2 * 3 * 2 * h * 8 * d_k * size
    assert kv_cache_bytes(3, 2, h, 8, d_k, dtype) == expected
    assert cache.nbytes == cache.memory_bytes() == cache.self_attn_nbytes == expected
    assert cache.nbytes == sum(t.nbytes for c in cache.self_attn for t in (c.k, c.v))


def test_misuse_raises_clear_errors():
    model = _lm(0)
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, V, (2, 5)), cache=cache)
        with pytest.raises(ValueError, match="B=2"):
            model(torch.randint(0, V, (3, 1)), cache=cache)
        with pytest.raises(ValueError, match="max_len=40"):
            model(torch.randint(0, V, (2, 36)), cache=cache)
        cache2 = model.new_cache()
        model(torch.randint(0, V, (1, 40)), cache=cache2)
        with pytest.raises(ValueError, match="max_len=40"):
            model(torch.randint(0, V, (1, 1)), cache=cache2)
        with pytest.raises(ValueError, match="DecoderCache"):
            model(torch.randint(0, V, (1, 1)), cache=KVCache())
        with pytest.raises(ValueError, match="positions"):
            model(torch.randint(0, V, (1, 1)), positions=torch.tensor([3]))
        with pytest.raises(ValueError, match=r"positions must lie in \[0, max_len=40\)"):
            model(torch.randint(0, V, (1, 1)), cache=model.new_cache(),
                  positions=torch.tensor([40]))
        with pytest.raises(ValueError, match="layers"):
            model(torch.randint(0, V, (1, 1)), cache=DecoderCache.for_stack(5))
    c = KVCache(max_len=4)
    c.append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="max_len=4"):
        c.append(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    with pytest.raises(ValueError, match="B=1"):
        c.append(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    with pytest.raises(ValueError, match="same shape"):
        c.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 2, 4))
    with pytest.raises(ValueError, match="use_cache"):
        generate(model, [[BOS]], 3, use_cache=1)


def test_generate_refuses_more_than_max_len_before_any_step():
    model = _lm(0)
    with pytest.raises(ValueError, match="max_len=40"):
        generate(model, [[BOS] * 10], max_new_tokens=32)
    assert len(generate(model, [[BOS] * 10], max_new_tokens=31)) == 1


def test_models_without_a_cache_still_decode():
    """A model that has no new_cache() is run the recomputing way, with use_cache=True too."""

    class Plain(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, tokens):
            return self.lm(tokens)

    model = _lm(1)
    prompts = _prompts(1, 3, ragged=True)
    assert generate(Plain(model), prompts, 10) == generate(model, prompts, 10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cache_lives_on_the_inputs_device():
    model = _lm(0).cuda()
    prompts = _prompts(0, 3, ragged=True)
    assert generate(model, prompts, 12) == generate(model, prompts, 12, use_cache=False)
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, V, (2, 4), device="cuda"), cache=cache)
    assert all(c.k.is_cuda and c.v.is_cuda for c in cache.self_attn)
    s2s = _s2s(0).cuda()
    src = torch.randint(3, V, (2, 6), device="cuda")
    assert (greedy_decode(s2s, src, src != PAD, 10)
            == greedy_decode(s2s, src, src != PAD, 10, use_cache=False))


@pytest.mark.parametrize("norm_first", [True, False])
def test_lm_with_grouped_query_attention_caches_fewer_heads(norm_first):
    """Layers whose self-attention is grouped-query cache h_kv heads, and decode the same."""
    model = _lm(4, norm_first, d_model=32, nhead=8)
    for layer in model.blocks.layers:
        layer.self_attn = GroupedQueryAttention.from_multi_head(layer.self_attn, 2)
    prompts = _prompts(4, 4, ragged=True)
    assert generate(model, prompts, 12) == generate(model, prompts, 12, use_cache=False)
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, V, (4, 9)), cache=cache)
    assert cache.self_attn[0].k.shape == (4, 2, 9, 4)  # 2 key/value heads of d_k = 32 / 8
    assert cache.nbytes == kv_cache_bytes(2, 4, 2, 9, 4)


@pytest.mark.parametrize("reserve", [None, 3, 9, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reserved_cache_gives_what_concatenation_gives(reserve, dtype):
    """A cache with reserved room writes in place and returns exactly what the concatenating
    cache returns, step by step: within the room, past it (back to concatenation), for a first
    chunk longer than the room, and with no reservation."""
    g = torch.Generator().manual_seed(0)
    plain, roomy = KVCache(max_len=20), KVCache(max_len=20)
    if reserve is not None:
        assert roomy.reserve(reserve) is roomy
    for n in (4, 1, 1, 3, 1, 2, 1):
        k = torch.randn(2, 3, n, 5, generator=g, dtype=dtype)
        v = torch.randn(2, 3, n, 5, generator=g, dtype=dtype)
        expected = plain.append(k, v)
        got = roomy.append(k, v)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
        assert roomy.length == plain.length
        assert torch.equal(roomy.k, plain.k) and torch.equal(roomy.v, plain.v)
    in_room = reserve is not None and reserve >= plain.length
    assert roomy.nbytes == (2 * 2 * 3 * reserve * 5 * plain.k.element_size() if in_room
                            else plain.nbytes)
    if in_room:  # every step wrote into one allocation
        assert roomy.k.data_ptr() == roomy._buffers[0].data_ptr()


def test_reserved_cache_keeps_earlier_results_and_autograd():
    """Writing in place never changes what an earlier append returned; with autograd the cache
    concatenates, so the backward pass through earlier steps still works."""
    cache = KVCache().reserve(10)
    k1, v1 = torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2)
    first_k, _ = cache.append(k1, v1)
    snapshot = first_k.clone()
    cache.append(torch.full((1, 1, 3, 2), 7.0), torch.full((1, 1, 3, 2), 7.0))
    assert torch.equal(first_k, snapshot)
    w = torch.ones(1, 1, 1, 2, requires_grad=True)
    grad_cache = KVCache().reserve(10)
    grad_cache.append(w * 2, w * 3)
    k_all, v_all = grad_cache.append(w * 4, w * 5)
    (k_all.sum() + v_all.sum()).backward()
    assert w.grad.tolist() == [[[[14.0, 14.0]]]]


def test_reserve_refuses_bad_lengths():
    with pytest.raises(ValueError, match="max_len=5"):
        KVCache(max_len=5).reserve(6)
    with pytest.raises(ValueError):
        KVCache().reserve(0)
    assert DecoderCache.for_stack(2, max_len=8).reserve(8).self_attn[1]._room == 8


def test_generate_reserves_exactly_the_positions_it_feeds():
    """generate's cache holds prompt + max_new_tokens - 1 positions in one allocation each."""
    model = _lm(0, max_len=12)
    seen = []
    make = model.new_cache

    def spy():
        cache = make()
        seen.append(cache)
        return cache

    model.new_cache = spy
    out = generate(model, [[BOS, 3, 4, 5]], max_new_tokens=9, eos=V + 5)
    assert len(out[0]) == 9
    (cache,) = seen
    assert all(c._room == 4 + 9 - 1 and c.length == 12 for c in cache.self_attn)
    assert cache.self_attn[0].k.data_ptr() == cache.self_attn[0]._buffers[0].data_ptr()


def test_training_after_generating_works():
    """Decoding runs under torch.inference_mode; nothing it leaves behind (the model's weights,
    kept attention weights) may break a training step that follows."""
    from utils.attention import keep_attention_weights
    from utils.train import token_cross_entropy

    model = keep_attention_weights(_lm(0).train())
    generate(model, [[BOS, 3, 4]], max_new_tokens=5)
    s2s = _s2s(0).train()
    src = torch.tensor([[BOS, 3, 4, EOS]])
    greedy_decode(s2s, src, src != PAD, max_len=4)
    assert model.training and s2s.training
    tokens = torch.tensor([[BOS, 3, 4, 5, 6]])
    loss = token_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    out = s2s(src, src[:, :-1], src != PAD, src[:, :-1] != PAD)
    token_cross_entropy(out, src[:, 1:]).backward()
