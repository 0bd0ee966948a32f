"""Whole models built from `utils.transformer`'s layers and stacks (chapters 9 and 10).

* `Seq2SeqTransformer`: the encoder-decoder of "Attention Is All You Need" with token
  embeddings, sinusoidal positions and an output projection.
* `DecoderOnlyLM`: a GPT-style causal language model: a stack of self-attention layers under a
  causal mask.
* `EncoderOnlyMLM`: a BERT-style masked-token model: the same stack with no causal mask.

None of them redefines attention, normalization or the feed-forward network: they only add what
turns token ids into vectors (`InputEmbedding`) and vectors back into scores over the vocabulary.
Every model's ``forward`` returns logits (B, L, V).

Every entry point checks its arguments before doing any work. Token ids must be an int64 or
int32 tensor (B, L) on the model's device, each id in [0, V), at most ``max_len`` positions; a
padding mask must be a bool (B, L) tensor on the same device. A float or bool tensor, or a tensor
on another device, raises `utils._validation.InputTypeError` (a `TypeError` and a `ValueError`);
a wrong shape or an id out of range raises `ValueError`, never an `IndexError` from inside
``nn.Embedding``. Degenerate input has a defined result: an empty batch (B = 0) or empty
sequences (L = 0) give empty logits (B, L, V), and a row whose tokens are all padding gives
finite logits (its queries have no key to attend to: see `utils.transformer`).
"""

from __future__ import annotations

import torch
from torch import nn

from ._validation import (
    InputTypeError,
    apply_dropout,
    require_bool,
    require_bool_mask,
    require_int,
    require_integer_ids,
    require_rank,
    require_same_device,
    require_tensor,
    shape_str,
    value_range,
    values_are_trusted,
)
from .kv_cache import DecoderCache
from .masks import mark_causal
from .positional import SinusoidalPositionalEncoding, TokenEmbedding
from .transformer import Encoder, Transformer
from .transformer_layers import _check_input, _check_same_batch

__all__ = ["InputEmbedding", "Seq2SeqTransformer", "DecoderOnlyLM", "EncoderOnlyMLM"]


def _check_tokens(name: str, tokens: object, embed: InputEmbedding) -> torch.Tensor:
    """``tokens`` must be (B, L) int64/int32 ids in [0, V) on ``embed``'s device, L <= max_len
    (unless ``embed.max_len`` is None: a model whose positions have no table, RoPE's)."""
    require_tensor(name, tokens)
    require_rank(name, tokens, "(B, L)", rank=2)
    require_integer_ids(name, tokens)
    if tokens.dtype not in (torch.int64, torch.int32):
        raise InputTypeError(f"{name} must hold integer token ids as torch.long (or int32), got "
                             f"dtype {tokens.dtype}")
    device = embed.weight.device
    if tokens.device != device:
        raise InputTypeError(f"{name} is on {tokens.device} but the model is on {device}; move "
                             f"them to one device ({name}.to('{device}'))")
    if embed.max_len is not None and tokens.shape[1] > embed.max_len:
        raise ValueError(f"{name} {shape_str(tokens)} is longer than max_len={embed.max_len}")
    if values_are_trusted():  # a decoding loop's own tokens: no wait for the device
        return tokens
    low, high = value_range(tokens) if tokens.numel() else (0, 0)
    if low < 0 or high >= embed.vocab_size:
        raise ValueError(f"{name} ids must lie in [0, {embed.vocab_size}), got ids from "
                         f"{low} to {high}")
    return tokens


def _check_pad_mask(name: str, mask: object, like: torch.Tensor,
                    shape: tuple[int, ...] | None = None) -> None:
    """``mask`` (None, or a bool tensor of ``shape``, default ``like``'s, on ``like``'s device)."""
    if mask is None:
        return
    require_tensor(name, mask)
    require_bool_mask(name, mask)
    shape = tuple(like.shape) if shape is None else shape
    if tuple(mask.shape) != shape:
        raise ValueError(f"{name} must be a bool (B, L) padding mask of shape {shape_str(shape)}"
                         f", True at real tokens; got {shape_str(mask)}")
    require_same_device(**{"the input": like, name: mask})


def _causal_after(past: int, length: int, device: torch.device) -> torch.Tensor:
    """The (1, L, past + L) causal mask of L new positions that follow ``past`` cached ones
    (past = 0: the usual (1, L, L) causal mask, for any L >= 0): new position i sees every
    cached position and the new ones up to itself."""
    return torch.ones(length, past + length, dtype=torch.bool, device=device).tril(past)[None]


def _self_mask(past: int, length: int, pad: torch.Tensor | None, cache: DecoderCache | None,
               device: torch.device) -> torch.Tensor | None:
    """The causal self-attention mask (1 or B, L, past + L), with the (B, past + L) padding mask
    ``pad`` if given. None for one new token fed to a cache without padding: it may see every
    position, and skipping an all-True mask saves work at every step of generation. Without a
    cache or padding the mask is marked (`utils.masks.mark_causal`): the attention recognizes
    it and runs PyTorch's causal kernel instead of reading it, to the same output."""
    if cache is not None and length == 1 and pad is None:
        return None
    if cache is None and pad is None:  # made outside inference mode: it can carry the mark
        with torch.inference_mode(False):
            return mark_causal(_causal_after(0, length, device))
    attn = _causal_after(past, length, device)
    return attn if pad is None else attn & pad[:, None, :]


def _check_cache(cache: object, tokens: torch.Tensor) -> DecoderCache:
    if not isinstance(cache, DecoderCache):
        raise InputTypeError(f"cache must be a DecoderCache (from the model's new_cache()) or "
                             f"None, got {type(cache).__name__}")
    if cache.length + tokens.shape[1] > _max_positions(cache):
        raise ValueError(f"the cache holds {cache.length} positions; {tokens.shape[1]} more "
                         f"would exceed the model's max_len={_max_positions(cache)}")
    return cache


def _max_positions(cache: DecoderCache) -> int:
    limit = cache.self_attn[0].max_len if cache.self_attn else None
    return limit if limit is not None else 2**62


def _check_positions(positions: object, tokens: torch.Tensor,
                     max_len: int | None) -> torch.Tensor:
    """``positions``: int (L,) or (B, L) absolute positions in [0, max_len) for ``tokens``
    (max_len None: any position >= 0)."""
    require_tensor("positions", positions)
    require_integer_ids("positions", positions)
    b, length = tokens.shape
    if tuple(positions.shape) not in ((length,), (b, length)):
        raise ValueError(f"positions must have shape (L,) = ({length},) or (B, L) = "
                         f"{shape_str(tokens)}, got {shape_str(positions)}")
    require_same_device(tokens=tokens, positions=positions)
    if max_len is not None:
        _require_below("positions", positions, max_len, "max_len")
    elif not values_are_trusted() and positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
    return positions


def _require_below(name: str, ids: torch.Tensor, limit: int, bound: str) -> None:
    """Every value of ``ids`` in [0, limit); ``bound`` names the limit in the message."""
    if values_are_trusted():  # a decoding loop's own positions: no wait for the device
        return
    low, high = value_range(ids) if ids.numel() else (0, 0)
    if low < 0 or high >= limit:
        raise ValueError(f"{name} must lie in [0, {bound}={limit}), got {name} from {low} to "
                         f"{high}")


def _rows_at(h: torch.Tensor, logits_at: object) -> torch.Tensor:
    """The vectors of ``h`` (B, L, d) at ``logits_at`` ((B, K) ints in [0, L), per row): (B, K, d).
    A model that is asked for a few positions' logits computes its output layer only there
    (generation's first step needs each prompt's last position, not all L)."""
    if logits_at is None:
        return h
    require_tensor("logits_at", logits_at)
    require_integer_ids("logits_at", logits_at)
    b, length = h.shape[:2]
    if logits_at.dim() != 2 or logits_at.shape[0] != b:
        raise ValueError(f"logits_at must have shape (B={b}, K), positions among the L={length} "
                         f"new tokens, got {shape_str(logits_at)}")
    require_same_device(tokens=h, logits_at=logits_at)
    _require_below("logits_at", logits_at, length, "L")
    return h.gather(1, logits_at[..., None].expand(-1, -1, h.shape[-1]))


class InputEmbedding(nn.Module):
    """Token ids -> vectors: a learned embedding scaled by sqrt(d_model), plus positions.

    x_t = sqrt(d_model) * E[token_t] + PE[t]: chapter 5's pieces put together, the scaled
    `utils.positional.TokenEmbedding` followed by `utils.positional.SinusoidalPositionalEncoding`
    (no dropout). The table E starts from N(0, 1 / d_model), so that sqrt(d_model) * E[token] has
    entries of unit size, like PE's; its transpose can double as the output projection ("tied"
    weights).

    Args:
        vocab_size: V, the number of token ids, a positive int.
        d_model: the width of the vectors, a positive int (even when ``positional``).
        max_len: the longest sequence the positional table covers, a positive int.
        positional: add PE (False gives a model that cannot tell positions apart: the ablation
            of chapter 9).

    Shapes:
        tokens (B, L) int -> (B, L, d_model); B = 0 or L = 0 gives an empty output.
    """

    def __init__(self, vocab_size: int, d_model: int, max_len: int = 64, positional: bool = True):
        super().__init__()
        vocab_size = require_int("vocab_size", vocab_size)
        d_model = require_int("d_model", d_model)
        max_len = require_int("max_len", max_len)
        require_bool("positional", positional)
        if positional and d_model % 2:
            raise ValueError(f"d_model must be even for the sinusoidal positions (sines and "
                             f"cosines come in pairs), got {d_model}")
        self.vocab_size, self.d_model, self.max_len = vocab_size, d_model, max_len
        self.positional = positional
        self.tokens = TokenEmbedding(vocab_size, d_model)
        self.positions = SinusoidalPositionalEncoding(d_model, max_len) if positional else None

    @property
    def weight(self) -> nn.Parameter:
        """The (V, d_model) embedding table E."""
        return self.tokens.embedding.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) ids -> (B, L, d_model) vectors.

        ``positions``, optional, gives each token's absolute position: an int (L,) tensor shared
        by the batch or (B, L), each in [0, max_len). The default is 0, 1, ..., L - 1. A decoder
        fed one new token at a time with a key/value cache passes the position it sits at.
        """
        _check_tokens("tokens", tokens, self)
        x = self.tokens(tokens)
        if self.positions is None:
            return x
        if positions is None:
            return self.positions(x)
        positions = _check_positions(positions, tokens, self.max_len)
        return apply_dropout(self.positions.dropout, x + self.positions.pe[positions].to(x.dtype))


class _OutputHead(nn.Module):
    """Vectors (B, L, d_model) -> logits (B, L, V): x E^T with a tied table, else a Linear."""

    def __init__(self, embedding: InputEmbedding, tied: bool):
        super().__init__()
        self.tied = tied
        if tied:
            self.embedding = [embedding]  # a list, so that the table is not registered twice
            self.bias = nn.Parameter(torch.zeros(embedding.vocab_size))
        else:
            self.proj = nn.Linear(embedding.d_model, embedding.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tied:
            return x @ self.embedding[0].weight.T + self.bias
        return self.proj(x)


def _stack_kwargs(d_model: object, nhead: object, dim_feedforward: object, dropout: object,
                  activation: object, norm_first: object) -> dict[str, object]:
    """The settings shared by the layers; d_model must be a positive even int (for the
    sinusoidal positions). The rest is checked by the layers themselves."""
    d_model = require_int("d_model", d_model)
    if d_model % 2:
        raise ValueError(f"d_model must be positive and even, got {d_model}")
    if dim_feedforward is not None:
        require_int("dim_feedforward", dim_feedforward)
    require_bool("norm_first", norm_first)
    return dict(d_model=d_model, nhead=nhead,
                dim_feedforward=4 * d_model if dim_feedforward is None else dim_feedforward,
                dropout=dropout, activation=activation, norm_first=norm_first)


class Seq2SeqTransformer(nn.Module):
    """An encoder-decoder Transformer over tokens: embeddings, `utils.transformer.Transformer`,
    and an output projection.

    Args:
        src_vocab_size, tgt_vocab_size: the vocabularies of source and target.
        d_model, nhead, num_encoder_layers, num_decoder_layers, dim_feedforward (default
            4 * d_model), dropout, activation, norm_first: as in `Transformer`.
        max_len: the longest source or target sequence.
        positional: add sinusoidal positions to the embeddings.
        tie_output: the output projection reuses the target embedding table (its transpose).
        share_embeddings: source and target use one table (needs equal vocabularies).

    Shapes:
        src (B, L_s), tgt (B, L_t) ids -> logits (B, L_t, tgt_vocab_size). L_t = 0 gives
        empty logits; with a fully padded source, cross-attention gives just its bias b_O.

    ``max_len`` is kept as an attribute: `utils.decoding` reads it to refuse, before decoding,
    a request for more tokens than the model can take.
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, d_model: int = 64,
                 nhead: int = 4, num_encoder_layers: int = 1, num_decoder_layers: int = 1,
                 dim_feedforward: int | None = None, dropout: float = 0.0,
                 activation: str = "relu", norm_first: bool = False, max_len: int = 64,
                 positional: bool = True, tie_output: bool = True,
                 share_embeddings: bool = False):
        super().__init__()
        kw = _stack_kwargs(d_model, nhead, dim_feedforward, dropout, activation, norm_first)
        src_vocab_size = require_int("src_vocab_size", src_vocab_size)
        tgt_vocab_size = require_int("tgt_vocab_size", tgt_vocab_size)
        self.max_len = require_int("max_len", max_len)
        for name, flag in (("positional", positional), ("tie_output", tie_output),
                           ("share_embeddings", share_embeddings)):
            require_bool(name, flag)
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(f"share_embeddings needs equal vocabularies, got {src_vocab_size} "
                             f"and {tgt_vocab_size}")
        self.d_model = d_model
        self.transformer = Transformer(num_encoder_layers=num_encoder_layers,
                                       num_decoder_layers=num_decoder_layers, **kw)
        self.tgt_embed = InputEmbedding(tgt_vocab_size, d_model, max_len, positional)
        self.src_embed = (self.tgt_embed if share_embeddings
                          else InputEmbedding(src_vocab_size, d_model, max_len, positional))
        self.head = _OutputHead(self.tgt_embed, tie_output)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The memory (B, L_s, d_model); ``src_mask`` (B, L_s) is True at real tokens."""
        _check_tokens("src", src, self.src_embed)
        _check_pad_mask("src_mask", src_mask, src)
        pad = None if src_mask is None else src_mask[:, None, :]
        return self.transformer.encode(self.src_embed(src), pad)

    def new_cache(self) -> DecoderCache:
        """An empty key/value cache for `decode` (self- and cross-attention, every layer)."""
        return DecoderCache.for_stack(self.transformer.decoder.num_layers, cross_attention=True,
                                      max_len=self.max_len)

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor | None = None,
               tgt_mask: torch.Tensor | None = None,
               cache: DecoderCache | None = None) -> torch.Tensor:
        """Logits (B, L_t, V) for the decoder input ``tgt`` (B, L_t) given the memory.

        The decoder's self-attention is causal (and, with ``tgt_mask`` (B, L_t), ignores target
        padding); its cross-attention ignores source padding when ``src_mask`` is given.

        With a ``cache`` (from `new_cache`), ``tgt`` holds only the new target tokens, at
        positions L_past, L_past + 1, ... after the L_past already in the cache; the logits are
        those of the new positions, the same as the last L_t rows that a call on the whole
        prefix would give. ``tgt_mask`` then covers all L_past + L_t positions. The first call
        also stores the memory's keys and values, reused by every later call: pass the same
        ``memory`` each time.
        """
        _check_tokens("tgt", tgt, self.tgt_embed)
        past = 0
        if cache is not None:
            _check_cache(cache, tgt)
            past = cache.length
        _check_pad_mask("tgt_mask", tgt_mask, tgt, (tgt.shape[0], past + tgt.shape[1]))
        _check_input("memory", memory, self.transformer, "(B, L_s, d_model)")
        _check_same_batch("tgt", tgt, "memory", memory)
        _check_pad_mask("src_mask", src_mask, memory, tuple(memory.shape[:2]))
        self_mask = _self_mask(past, tgt.shape[1], tgt_mask, cache, tgt.device)
        cross = None if src_mask is None else src_mask[:, None, :]
        positions = None
        if cache is not None:
            positions = torch.arange(past, past + tgt.shape[1], device=tgt.device)
        y = self.transformer.decode(self.tgt_embed(tgt, positions), memory, self_mask, cross,
                                    cache=cache)
        return self.head(y)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_mask: torch.Tensor | None = None,
                tgt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher forcing: logits (B, L_t, V) for every position of ``tgt`` at once."""
        _check_tokens("src", src, self.src_embed)
        _check_tokens("tgt", tgt, self.tgt_embed)
        _check_same_batch("src", src, "tgt", tgt)
        _check_pad_mask("tgt_mask", tgt_mask, tgt)
        return self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask)


class _TokenStack(nn.Module):
    """What `DecoderOnlyLM` and `EncoderOnlyMLM` share: embeddings, one `utils.transformer.Encoder`
    stack and an output head, made in that order. The stack ends in a LayerNorm always when
    ``always_final_norm`` (a causal LM), else exactly when it is pre-LN."""

    always_final_norm = True

    def __init__(self, vocab_size: int, d_model: int = 64, nhead: int = 4, num_layers: int = 2,
                 dim_feedforward: int | None = None, dropout: float = 0.0,
                 activation: str = "gelu", norm_first: bool = True, max_len: int = 64,
                 tie_output: bool = True):
        super().__init__()
        kw = _stack_kwargs(d_model, nhead, dim_feedforward, dropout, activation, norm_first)
        require_bool("tie_output", tie_output)
        self.d_model = d_model
        self.embed = InputEmbedding(vocab_size, d_model, max_len)
        self.vocab_size, self.max_len = self.embed.vocab_size, self.embed.max_len
        self.blocks = Encoder(num_layers, final_norm=self.always_final_norm or norm_first, **kw)
        self.head = _OutputHead(self.embed, tie_output)


class DecoderOnlyLM(_TokenStack):
    """A GPT-style causal language model.

    Embeddings, a stack of self-attention layers (`utils.transformer.Encoder`'s layers: a
    decoder without an encoder has no cross-attention, so its layers are exactly these) run
    under a causal mask, a final LayerNorm, and an output projection tied to the embedding. Pre-LN
    (``norm_first=True``) by default, as in GPT-2.

    Shapes:
        tokens (B, L) -> logits (B, L, V); position t's logits score token t + 1. L = 0 gives
        empty logits.

    ``vocab_size`` and ``max_len`` are kept as attributes; `utils.decoding.generate` reads
    ``max_len`` to refuse, before generating, more tokens than the model can take.
    """

    def new_cache(self) -> DecoderCache:
        """An empty key/value cache (one per layer) for `forward`, holding up to ``max_len``
        positions."""
        return DecoderCache.for_stack(self.blocks.num_layers, max_len=self.max_len)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None,
                cache: DecoderCache | None = None, positions: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, L, V). ``mask`` (B, L), True at real tokens, is optional: with right
        padding the causal mask already keeps every real token from seeing the padding.
        ``logits_at`` ((B, K) ints in [0, L)) computes the output layer only at those positions
        of each row: logits (B, K, V), equal to those rows of the full output.

        Incremental decoding: with a ``cache`` (from `new_cache`) holding L_past positions,
        ``tokens`` are only the L new tokens; their keys and values are appended to the cache
        and the logits (B, L, V) are those of the new tokens, equal (to rounding) to the last
        L rows of a call on the whole sequence. The new tokens sit at positions L_past, ...,
        L_past + L - 1 unless ``positions`` ((L,) or (B, L) ints) says otherwise; ``mask`` is
        then (B, L_past + L), True at the cache slots (and new tokens) each row may attend to.
        Growing the cache past ``max_len`` positions raises a `ValueError`.
        """
        _check_tokens("tokens", tokens, self.embed)
        past = 0
        if cache is not None:
            _check_cache(cache, tokens)
            past = cache.length
        elif positions is not None:
            raise ValueError("positions are only taken together with a cache")
        _check_pad_mask("mask", mask, tokens, (tokens.shape[0], past + tokens.shape[1]))
        attn = _self_mask(past, tokens.shape[1], mask, cache, tokens.device)
        if cache is not None and positions is None:
            positions = torch.arange(past, past + tokens.shape[1], device=tokens.device)
        h = self.blocks(self.embed(tokens, positions), attn, cache=cache)
        return self.head(_rows_at(h, logits_at))


class EncoderOnlyMLM(_TokenStack):
    """A BERT-style encoder for masked-token prediction.

    Embeddings, a stack of `utils.transformer.EncoderLayer`s in which every token attends to
    every real token (only padding is masked), and an output projection tied to the embedding.
    Post-LN by default, as in BERT.

    Shapes:
        tokens (B, L), mask (B, L) -> logits (B, L, V).
    """

    always_final_norm = False

    def __init__(self, vocab_size: int, d_model: int = 64, nhead: int = 4, num_layers: int = 2,
                 dim_feedforward: int | None = None, dropout: float = 0.0,
                 activation: str = "gelu", norm_first: bool = False, max_len: int = 64,
                 tie_output: bool = True):
        super().__init__(vocab_size, d_model, nhead, num_layers, dim_feedforward, dropout,
                         activation, norm_first, max_len, tie_output)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, L, V); ``mask`` (B, L) is True at real tokens."""
        _check_tokens("tokens", tokens, self.embed)
        _check_pad_mask("mask", mask, tokens)
        attn = None if mask is None else mask[:, None, :]
        return self.head(self.blocks(self.embed(tokens), attn))
