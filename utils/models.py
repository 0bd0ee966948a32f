"""Whole models built from `utils.transformer`'s layers and stacks (chapters 9 and 10).

* `Seq2SeqTransformer`: the encoder-decoder of "Attention Is All You Need" with token
  embeddings, sinusoidal positions and an output projection.
* `DecoderOnlyLM`: a GPT-style causal language model: a stack of self-attention layers under a
  causal mask.
* `EncoderOnlyMLM`: a BERT-style masked-token model: the same stack with no causal mask.

None of them redefines attention, normalization or the feed-forward network: they only add what
turns token ids into vectors (`InputEmbedding`) and vectors back into scores over the vocabulary.
Every model's ``forward`` returns logits (B, L, V).
"""

from __future__ import annotations

import torch
from torch import nn

from ._validation import require_rank, require_tensor, shape_str
from .masks import causal_mask
from .positional import SinusoidalPositionalEncoding, TokenEmbedding
from .transformer import Encoder, Transformer

__all__ = ["InputEmbedding", "Seq2SeqTransformer", "DecoderOnlyLM", "EncoderOnlyMLM"]


def _check_tokens(name: str, tokens: object, vocab_size: int, max_len: int) -> torch.Tensor:
    require_tensor(name, tokens)
    require_rank(name, tokens, "(B, L)", rank=2)
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.shape[1] > max_len:
        raise ValueError(f"{name} {shape_str(tokens)} is longer than max_len={max_len}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"{name} ids must lie in [0, {vocab_size}), got ids from "
                         f"{int(tokens.min())} to {int(tokens.max())}")
    return tokens


def _check_pad_mask(name: str, mask: torch.Tensor | None, tokens: torch.Tensor) -> None:
    if mask is None:
        return
    require_tensor(name, mask)
    if mask.dtype != torch.bool or mask.shape != tokens.shape:
        raise ValueError(f"{name} must be a bool (B, L) padding mask of shape {shape_str(tokens)}"
                         f", True at real tokens; got {mask.dtype} {shape_str(mask)}")


class InputEmbedding(nn.Module):
    """Token ids -> vectors: a learned embedding scaled by sqrt(d_model), plus positions.

    x_t = sqrt(d_model) * E[token_t] + PE[t]: chapter 5's pieces put together, the scaled
    `utils.positional.TokenEmbedding` followed by `utils.positional.SinusoidalPositionalEncoding`
    (no dropout). The table E starts from N(0, 1 / d_model), so that sqrt(d_model) * E[token] has
    entries of unit size, like PE's; its transpose can double as the output projection ("tied"
    weights).

    Args:
        vocab_size: V, the number of token ids.
        d_model: the width of the vectors (even).
        max_len: the longest sequence the positional table covers.
        positional: add PE (False gives a model that cannot tell positions apart: the ablation
            of chapter 9).

    Shapes:
        tokens (B, L) int -> (B, L, d_model).
    """

    def __init__(self, vocab_size: int, d_model: int, max_len: int = 64, positional: bool = True):
        super().__init__()
        if vocab_size <= 0 or d_model <= 0 or max_len <= 0:
            raise ValueError(f"vocab_size, d_model and max_len must be positive, got "
                             f"{vocab_size}, {d_model}, {max_len}")
        self.vocab_size, self.d_model, self.max_len = vocab_size, d_model, max_len
        self.positional = positional
        self.tokens = TokenEmbedding(vocab_size, d_model)
        self.positions = SinusoidalPositionalEncoding(d_model, max_len) if positional else None

    @property
    def weight(self) -> nn.Parameter:
        """The (V, d_model) embedding table E."""
        return self.tokens.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_tokens("tokens", tokens, self.vocab_size, self.max_len)
        x = self.tokens(tokens)
        return x if self.positions is None else self.positions(x)


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


def _stack_kwargs(d_model, nhead, dim_feedforward, dropout, activation, norm_first):
    if d_model <= 0 or d_model % 2:
        raise ValueError(f"d_model must be positive and even, got {d_model}")
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
        src (B, L_s), tgt (B, L_t) ids -> logits (B, L_t, tgt_vocab_size).
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, d_model: int = 64,
                 nhead: int = 4, num_encoder_layers: int = 1, num_decoder_layers: int = 1,
                 dim_feedforward: int | None = None, dropout: float = 0.0,
                 activation: str = "relu", norm_first: bool = False, max_len: int = 64,
                 positional: bool = True, tie_output: bool = True,
                 share_embeddings: bool = False):
        super().__init__()
        kw = _stack_kwargs(d_model, nhead, dim_feedforward, dropout, activation, norm_first)
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
        _check_tokens("src", src, self.src_embed.vocab_size, self.src_embed.max_len)
        _check_pad_mask("src_mask", src_mask, src)
        pad = None if src_mask is None else src_mask[:, None, :]
        return self.transformer.encode(self.src_embed(src), pad)

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor | None = None,
               tgt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, L_t, V) for the decoder input ``tgt`` (B, L_t) given the memory.

        The decoder's self-attention is causal (and, with ``tgt_mask`` (B, L_t), ignores target
        padding); its cross-attention ignores source padding when ``src_mask`` is given.
        """
        _check_tokens("tgt", tgt, self.tgt_embed.vocab_size, self.tgt_embed.max_len)
        _check_pad_mask("tgt_mask", tgt_mask, tgt)
        self_mask = causal_mask(tgt.shape[1], device=tgt.device)[None]  # (1, L_t, L_t)
        if tgt_mask is not None:
            self_mask = self_mask & tgt_mask[:, None, :]
        if src_mask is not None and src_mask.shape != memory.shape[:2]:
            raise ValueError(f"src_mask must have shape (B, L_s) = {shape_str(memory.shape[:2])},"
                             f" got {shape_str(src_mask)}")
        cross = None if src_mask is None else src_mask[:, None, :]
        y = self.transformer.decode(self.tgt_embed(tgt), memory, self_mask, cross)
        return self.head(y)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_mask: torch.Tensor | None = None,
                tgt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher forcing: logits (B, L_t, V) for every position of ``tgt`` at once."""
        return self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask)


class DecoderOnlyLM(nn.Module):
    """A GPT-style causal language model.

    Embeddings, a stack of self-attention layers (`utils.transformer.Encoder`'s layers: a
    decoder without an encoder has no cross-attention, so its layers are exactly these) run
    under a causal mask, a final LayerNorm, and an output projection tied to the embedding. Pre-LN
    (``norm_first=True``) by default, as in GPT-2.

    Shapes:
        tokens (B, L) -> logits (B, L, V); position t's logits score token t + 1.
    """

    def __init__(self, vocab_size: int, d_model: int = 64, nhead: int = 4, num_layers: int = 2,
                 dim_feedforward: int | None = None, dropout: float = 0.0,
                 activation: str = "gelu", norm_first: bool = True, max_len: int = 64,
                 tie_output: bool = True):
        super().__init__()
        kw = _stack_kwargs(d_model, nhead, dim_feedforward, dropout, activation, norm_first)
        self.d_model = d_model
        self.embed = InputEmbedding(vocab_size, d_model, max_len)
        self.blocks = Encoder(num_layers, final_norm=True, **kw)
        self.head = _OutputHead(self.embed, tie_output)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, L, V). ``mask`` (B, L), True at real tokens, is optional: with right
        padding the causal mask already keeps every real token from seeing the padding."""
        _check_tokens("tokens", tokens, self.embed.vocab_size, self.embed.max_len)
        _check_pad_mask("mask", mask, tokens)
        attn = causal_mask(tokens.shape[1], device=tokens.device)[None]  # (1, L, L)
        if mask is not None:
            attn = attn & mask[:, None, :]
        return self.head(self.blocks(self.embed(tokens), attn))


class EncoderOnlyMLM(nn.Module):
    """A BERT-style encoder for masked-token prediction.

    Embeddings, a stack of `utils.transformer.EncoderLayer`s in which every token attends to
    every real token (only padding is masked), and an output projection tied to the embedding.
    Post-LN by default, as in BERT.

    Shapes:
        tokens (B, L), mask (B, L) -> logits (B, L, V).
    """

    def __init__(self, vocab_size: int, d_model: int = 64, nhead: int = 4, num_layers: int = 2,
                 dim_feedforward: int | None = None, dropout: float = 0.0,
                 activation: str = "gelu", norm_first: bool = False, max_len: int = 64,
                 tie_output: bool = True):
        super().__init__()
        kw = _stack_kwargs(d_model, nhead, dim_feedforward, dropout, activation, norm_first)
        self.d_model = d_model
        self.embed = InputEmbedding(vocab_size, d_model, max_len)
        self.blocks = Encoder(num_layers, final_norm=norm_first, **kw)
        self.head = _OutputHead(self.embed, tie_output)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, L, V); ``mask`` (B, L) is True at real tokens."""
        _check_tokens("tokens", tokens, self.embed.vocab_size, self.embed.max_len)
        _check_pad_mask("mask", mask, tokens)
        attn = None if mask is None else mask[:, None, :]
        return self.head(self.blocks(self.embed(tokens), attn))
