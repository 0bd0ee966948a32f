"""Bad and degenerate input to the model modules, table by table, through their public API.

utils.transformer, utils.models, utils.decoding, utils.train and utils.data must never answer
wrong in silence: every bad argument raises a ValueError or a TypeError (InputTypeError, which is
both, for a wrong type, dtype or device) whose message names what was expected, before any work
is done; every valid but degenerate input gives the result its docstring promises; from_torch
refuses what it cannot copy exactly and copies exactly what it accepts; and the train/eval mode
of every submodule and the grad mode are put back on every exit path.

Each table row is (id, call, expected exception, a phrase the message must contain) or
(id, call, check of the result). Models are tiny, so the file runs in a few seconds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from utils import costs
from utils._validation import InputTypeError
from utils.data import BOS, EOS, PAD, Seq2SeqBatch, Vocab, pad_sequences
from utils.decoding import generate, greedy_decode, next_token, sample_decode
from utils.masks import causal_mask, padding_mask
from utils.models import DecoderOnlyLM, EncoderOnlyMLM, InputEmbedding, Seq2SeqTransformer
from utils.tasks import MissingDigitTask, ReversalTask, SortingTask
from utils.train import (
    exact_match,
    token_accuracy,
    token_cross_entropy,
    train,
    warmup_linear_decay,
)
from utils.transformer import Decoder, DecoderLayer, Encoder, EncoderLayer, Transformer

# torch warns that nested tensors are a prototype, and that some stacks cannot use them.
pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
]

D, H, FF, V = 8, 2, 16, 11
G = torch.Generator().manual_seed(0)
X = torch.randn(2, 5, D, generator=G)        # (B, L_t, d_model)
MEM = torch.randn(2, 3, D, generator=G)      # (B, L_s, d_model)
TOK = torch.tensor([[3, 4, 5], [6, 7, PAD]])
ON_META = torch.empty(2, 5, D, device="meta")
BOOL = torch.bool


def enc_layer() -> EncoderLayer:
    return EncoderLayer(D, H, FF, dropout=0.0).eval()


def dec_layer() -> DecoderLayer:
    return DecoderLayer(D, H, FF, dropout=0.0).eval()


def encoder() -> Encoder:
    return Encoder(2, D, H, FF, dropout=0.0, final_norm=True).eval()


def decoder() -> Decoder:
    return Decoder(2, D, H, FF, dropout=0.0, final_norm=True).eval()


def transformer() -> Transformer:
    return Transformer(D, H, 1, 1, FF, dropout=0.0).eval()


def s2s() -> Seq2SeqTransformer:
    return Seq2SeqTransformer(V, V, d_model=D, nhead=H, max_len=16).eval()


def lm(max_len: int = 16) -> DecoderOnlyLM:
    return DecoderOnlyLM(V, d_model=D, nhead=H, num_layers=1, max_len=max_len).eval()


def mlm() -> EncoderOnlyMLM:
    return EncoderOnlyMLM(V, d_model=D, nhead=H, num_layers=1, max_len=16).eval()


class CountingLM(nn.Module):
    """A fake causal LM: after token x it predicts x + 1, and <eos> after 9; counts its calls."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(12))
        self.calls = 0

    def forward(self, tokens):
        self.calls += 1
        nxt = torch.where(tokens >= 9, torch.full_like(tokens, EOS), tokens + 1)
        return F.one_hot(nxt, 12).float() * 10.0 + self.bias


class FakeSeq2Seq(nn.Module):
    """A fake encoder-decoder that always predicts token 5; counts its calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def encode(self, src, src_mask):
        self.calls += 1
        return torch.zeros(src.shape[0], src.shape[1], 4)

    def decode(self, tgt, memory, src_mask):
        self.calls += 1
        return F.one_hot(torch.full(tgt.shape, 5), 12).float()


def seq_loss(model, batch):
    return model(batch).pow(2).mean()


def endless():
    while True:
        yield torch.ones(3, 2)


def lin() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(2, 1)


LOGITS = torch.randn(2, 3, 5, generator=G)
TARGETS = torch.tensor([[3, 4, PAD], [1, PAD, PAD]])
SRC = torch.tensor([[3, 4]])
SRC_MASK = torch.ones(1, 2, dtype=BOOL)


def row(id_, call, exc, phrase):
    return pytest.param(call, exc, phrase, id=id_)


# ---------------------------------------------------------------------------------------------
# Bad input: (call, exception, phrase in the message)
# ---------------------------------------------------------------------------------------------

CONSTRUCTORS = [
    row("EncoderLayer nhead=2.5", lambda: EncoderLayer(8, 2.5, 16.7), InputTypeError,
        "nhead must be a positive int, got 2.5"),
    row("EncoderLayer nhead=True", lambda: EncoderLayer(8, True, 16), InputTypeError,
        "nhead must be a positive int, got True"),
    row("EncoderLayer d_ff=16.7", lambda: EncoderLayer(8, 2, 16.7), InputTypeError,
        "dim_feedforward must be a positive int, got 16.7"),
    row("DecoderLayer d_model=8.0", lambda: DecoderLayer(8.0, 2, 16), InputTypeError,
        "d_model must be a positive int, got 8.0"),
    row("DecoderLayer d_model=0", lambda: DecoderLayer(0, 2, 16), ValueError,
        "d_model must be a positive int, got 0"),
    row("EncoderLayer d_ff alias 2.0", lambda: EncoderLayer(8, 2, d_ff=2.0), InputTypeError,
        "d_ff must be a positive int"),
    row("EncoderLayer num_heads=-2", lambda: EncoderLayer(8, num_heads=-2), ValueError,
        "num_heads must be a positive int, got -2"),
    row("EncoderLayer heads do not divide", lambda: EncoderLayer(8, 3, 16), ValueError,
        "divisible"),
    row("EncoderLayer dropout=1.0", lambda: EncoderLayer(8, 2, 16, dropout=1.0), ValueError,
        "dropout must be a finite number in [0.0, 1.0), got 1.0"),
    row("EncoderLayer dropout=nan", lambda: EncoderLayer(8, 2, 16, dropout=math.nan), ValueError,
        "dropout"),
    row("EncoderLayer dropout='0.1'", lambda: EncoderLayer(8, 2, 16, dropout="0.1"),
        InputTypeError, "dropout must be a real number"),
    row("EncoderLayer activation='tanh'", lambda: EncoderLayer(8, 2, 16, activation="tanh"),
        ValueError, "activation must be one of ('relu', 'gelu'), got 'tanh'"),
    row("EncoderLayer activation=nn.GELU()", lambda: EncoderLayer(8, 2, 16, activation=nn.GELU()),
        InputTypeError, "activation must be one of ('relu', 'gelu')"),
    row("DecoderLayer norm_first=1", lambda: DecoderLayer(8, 2, 16, norm_first=1),
        InputTypeError, "norm_first must be True or False, got 1"),
    row("EncoderLayer layer_norm_eps=0", lambda: EncoderLayer(8, 2, 16, layer_norm_eps=0.0),
        ValueError, "layer_norm_eps must be a finite number in (0.0, inf]"),
    row("Encoder num_layers=2.0", lambda: Encoder(2.0, 8, 2, 16), InputTypeError,
        "num_layers must be a positive int, got 2.0"),
    row("Decoder num_layers=True", lambda: Decoder(True, 8, 2, 16), InputTypeError,
        "num_layers must be a positive int, got True"),
    row("Encoder final_norm=None", lambda: Encoder(1, 8, 2, 16, final_norm=None), InputTypeError,
        "final_norm must be True or False"),
    row("Transformer num_decoder_layers=0", lambda: Transformer(8, 2, 1, 0, 16), ValueError,
        "num_decoder_layers must be a positive int, got 0"),
    row("Transformer num_encoder_layers=1.5", lambda: Transformer(8, 2, 1.5, 1, 16),
        InputTypeError, "num_encoder_layers must be a positive int, got 1.5"),
    row("InputEmbedding vocab_size=11.0", lambda: InputEmbedding(11.0, 8), InputTypeError,
        "vocab_size must be a positive int, got 11.0"),
    row("InputEmbedding odd d_model", lambda: InputEmbedding(11, 7), ValueError, "even"),
    row("InputEmbedding positional=1", lambda: InputEmbedding(11, 8, positional=1),
        InputTypeError, "positional must be True or False"),
    row("Seq2Seq tgt_vocab_size=0", lambda: Seq2SeqTransformer(5, 0, d_model=8, nhead=2),
        ValueError, "tgt_vocab_size must be a positive int, got 0"),
    row("Seq2Seq tie_output=1", lambda: Seq2SeqTransformer(5, 5, d_model=8, nhead=2,
                                                           tie_output=1),
        InputTypeError, "tie_output must be True or False"),
    row("Seq2Seq share_embeddings, unequal vocabularies",
        lambda: Seq2SeqTransformer(5, 6, d_model=8, nhead=2, share_embeddings=True), ValueError,
        "share_embeddings needs equal vocabularies, got 5 and 6"),
    row("DecoderOnlyLM nhead=2.5", lambda: DecoderOnlyLM(V, d_model=8, nhead=2.5), InputTypeError,
        "nhead must be a positive int, got 2.5"),
    row("DecoderOnlyLM num_layers=True", lambda: DecoderOnlyLM(V, d_model=8, num_layers=True),
        InputTypeError, "num_layers must be a positive int, got True"),
    row("EncoderOnlyMLM norm_first=1", lambda: EncoderOnlyMLM(V, d_model=8, norm_first=1),
        InputTypeError, "norm_first must be True or False"),
    row("EncoderOnlyMLM max_len=0", lambda: EncoderOnlyMLM(V, d_model=8, max_len=0), ValueError,
        "max_len must be a positive int, got 0"),
    row("EncoderOnlyMLM dim_feedforward=2.5",
        lambda: EncoderOnlyMLM(V, d_model=8, dim_feedforward=2.5), InputTypeError,
        "dim_feedforward must be a positive int, got 2.5"),
]

FORWARD = [
    row("EncoderLayer x float64", lambda: enc_layer()(X.double()), InputTypeError,
        "x has dtype torch.float64 but EncoderLayer's parameters are torch.float32"),
    row("EncoderLayer x int", lambda: enc_layer()(X.long()), InputTypeError,
        "x must be a floating-point tensor, got dtype torch.int64"),
    row("EncoderLayer x on meta", lambda: enc_layer()(ON_META), InputTypeError,
        "x is on meta but EncoderLayer's parameters are on cpu"),
    row("EncoderLayer x a list", lambda: enc_layer()([[0.0] * D]), InputTypeError,
        "x must be a torch.Tensor, got list"),
    row("EncoderLayer x 2-d", lambda: enc_layer()(X[0]), ValueError,
        "x must have shape (B, L, d_model=8) (3 dims), got (5, 8)"),
    row("EncoderLayer wrong d_model", lambda: enc_layer()(torch.randn(2, 5, 7)), ValueError,
        "x must have shape (B, L, d_model=8), got (2, 5, 7)"),
    row("EncoderLayer float mask", lambda: enc_layer()(X, torch.ones(2, 5)), InputTypeError,
        "mask must be a bool tensor (True = may attend), got dtype torch.float32"),
    row("EncoderLayer mask on meta",
        lambda: enc_layer()(X, torch.ones(2, 5, dtype=BOOL, device="meta")), InputTypeError,
        "mask is on meta but input is on cpu"),
    row("EncoderLayer mask of wrong shape", lambda: enc_layer()(X, torch.ones(2, 4, dtype=BOOL)),
        ValueError, "a 2-dim mask must be a (B, L_k) = (2, 5) padding mask"),
    row("EncoderLayer ambiguous mask", lambda: enc_layer()(torch.randn(4, 4, D), causal_mask(4)),
        ValueError, "ambiguous"),
    row("Encoder x float64", lambda: encoder()(X.double()), InputTypeError,
        "x has dtype torch.float64 but Encoder's parameters are torch.float32"),
    row("Encoder x on meta", lambda: encoder()(ON_META), InputTypeError, "x is on meta"),
    row("Encoder 1-dim mask", lambda: encoder()(X, torch.ones(5, dtype=BOOL)), ValueError,
        "mask must have 2, 3 or 4 dims"),
    row("DecoderLayer memory float64", lambda: dec_layer()(X, MEM.double()), InputTypeError,
        "memory has dtype torch.float64 but DecoderLayer's parameters are torch.float32"),
    row("DecoderLayer memory on meta",
        lambda: dec_layer()(X, torch.empty(2, 3, D, device="meta")), InputTypeError,
        "memory is on meta"),
    row("DecoderLayer memory of another batch size", lambda: dec_layer()(X, MEM[:1]), ValueError,
        "memory (1, 3, 8) and x (2, 5, 8) must have the same batch size B"),
    row("DecoderLayer int memory_mask",
        lambda: dec_layer()(X, MEM, None, torch.ones(2, 3, dtype=torch.long)), InputTypeError,
        "memory_mask must be a bool tensor"),
    row("Decoder tgt_mask of wrong shape",
        lambda: decoder()(X, MEM, torch.ones(4, 4, dtype=BOOL)), ValueError, "tgt_mask"),
    row("Decoder memory_mask on meta",
        lambda: decoder()(X, MEM, None, torch.ones(2, 3, dtype=BOOL, device="meta")),
        InputTypeError, "memory_mask is on meta"),
    row("Transformer src float64", lambda: transformer()(MEM.double(), X), InputTypeError,
        "src has dtype torch.float64"),
    row("Transformer tgt on meta", lambda: transformer()(MEM, ON_META), InputTypeError,
        "tgt is on meta"),
    row("Transformer batch sizes differ", lambda: transformer()(MEM[:1], X), ValueError,
        "src (1, 3, 8) and tgt (2, 5, 8) must have the same batch size B"),
    row("Transformer float src_mask", lambda: transformer()(MEM, X, torch.ones(2, 3)),
        InputTypeError, "src_mask must be a bool tensor"),
    row("Transformer.encode float64", lambda: transformer().encode(MEM.double()), InputTypeError,
        "src has dtype torch.float64"),
    row("Transformer.decode memory on meta",
        lambda: transformer().decode(X, torch.empty(2, 3, D, device="meta")), InputTypeError,
        "memory is on meta"),
    row("DecoderOnlyLM float tokens", lambda: lm()(TOK.float()), InputTypeError,
        "tokens must hold integer token ids"),
    row("DecoderOnlyLM id = V", lambda: lm()(torch.tensor([[3, V]])), ValueError,
        "tokens ids must lie in [0, 11), got ids from 3 to 11"),
    row("DecoderOnlyLM negative id", lambda: lm()(torch.tensor([[3, -1]])), ValueError,
        "tokens ids must lie in [0, 11), got ids from -1 to 3"),
    row("DecoderOnlyLM tokens on meta",
        lambda: lm()(torch.zeros(2, 3, dtype=torch.long, device="meta")), InputTypeError,
        "tokens is on meta but the model is on cpu"),
    row("DecoderOnlyLM uint8 tokens", lambda: lm()(TOK.to(torch.uint8)), InputTypeError,
        "torch.long (or int32), got dtype torch.uint8"),
    row("DecoderOnlyLM too long", lambda: lm()(torch.full((1, 17), 3)), ValueError,
        "tokens (1, 17) is longer than max_len=16"),
    row("DecoderOnlyLM mask on meta",
        lambda: lm()(TOK, torch.ones(2, 3, dtype=BOOL, device="meta")), InputTypeError,
        "mask is on meta"),
    row("EncoderOnlyMLM float mask", lambda: mlm()(TOK, torch.ones(2, 3)), InputTypeError,
        "mask must be a bool tensor"),
    row("EncoderOnlyMLM mask of wrong shape", lambda: mlm()(TOK, torch.ones(2, 4, dtype=BOOL)),
        ValueError, "padding mask of shape (2, 3)"),
    row("EncoderOnlyMLM tokens a list", lambda: mlm()([[3, 4]]), InputTypeError,
        "tokens must be a torch.Tensor, got list"),
    row("Seq2Seq float src", lambda: s2s()(TOK.float(), TOK), InputTypeError,
        "src must hold integer token ids"),
    row("Seq2Seq tgt of another batch size", lambda: s2s()(TOK, TOK[:1]), ValueError,
        "src (2, 3) and tgt (1, 3) must have the same batch size B"),
    row("Seq2Seq.decode memory float64",
        lambda: s2s().decode(TOK, torch.randn(2, 3, D, dtype=torch.float64)), InputTypeError,
        "memory has dtype torch.float64"),
    row("Seq2Seq.decode list src_mask",
        lambda: s2s().decode(TOK, torch.randn(2, 3, D), [[True] * 3] * 2), InputTypeError,
        "src_mask must be a torch.Tensor, got list"),
    row("Seq2Seq.decode src_mask of wrong shape",
        lambda: s2s().decode(TOK, torch.randn(2, 3, D), torch.ones(2, 4, dtype=BOOL)), ValueError,
        "src_mask must be a bool (B, L) padding mask of shape (2, 3)"),
]

COUNTS = [
    row("count_parameters of a list", lambda: costs.count_parameters([1]), InputTypeError,
        "module must be an nn.Module, got list"),
    row("count_parameters trainable_only=1", lambda: costs.count_parameters(nn.Linear(2, 2), 1),
        InputTypeError, "trainable_only must be True or False"),
    row("param_breakdown nhead=True", lambda: costs.transformer_param_breakdown(8, True, 16, 1, 1),
        InputTypeError, "nhead must be a positive int, got True"),
    row("param_breakdown layers=1.5", lambda: costs.transformer_param_breakdown(8, 2, 16, 1.5, 1),
        InputTypeError, "num_encoder_layers must be an int >= 0, got 1.5"),
    row("param_breakdown vocab_size=-1",
        lambda: costs.transformer_param_breakdown(8, 2, 16, 1, 1, -1), ValueError,
        "vocab_size must be an int >= 0, got -1"),
    row("param_count tied='no'", lambda: costs.transformer_param_count(8, 2, 16, 1, 1, 4, "no"),
        InputTypeError, "tied must be True or False"),
    row("flops seq_len=2.5", lambda: costs.encoder_layer_flops(2.5, 8, 16), InputTypeError,
        "seq_len must be a positive int, got 2.5"),
    row("flops d_ff=0", lambda: costs.encoder_layer_flops(3, 8, 0), ValueError,
        "d_ff must be a positive int, got 0"),
]

DECODING = [
    row("generate max_new_tokens=0", lambda: generate(CountingLM(), [[BOS]], 0), ValueError,
        "max_new_tokens must be a positive int, got 0"),
    row("generate max_new_tokens=-1", lambda: generate(CountingLM(), [[BOS]], -1), ValueError,
        "max_new_tokens must be a positive int, got -1"),
    row("generate max_new_tokens=2.0", lambda: generate(CountingLM(), [[BOS]], 2.0),
        InputTypeError, "max_new_tokens must be a positive int, got 2.0"),
    row("generate max_new_tokens=True", lambda: generate(CountingLM(), [[BOS]], True),
        InputTypeError, "max_new_tokens must be a positive int, got True"),
    row("generate an empty prompt", lambda: generate(CountingLM(), [[BOS], []], 2), ValueError,
        "non-empty"),
    row("generate a flat list of ids", lambda: generate(CountingLM(), [1, 2], 2), InputTypeError,
        "prompts[0] is int"),
    row("generate a string", lambda: generate(CountingLM(), "12", 2), InputTypeError,
        "prompts must be a list of prompts"),
    row("generate float ids", lambda: generate(CountingLM(), [[1.5]], 2), InputTypeError,
        "prompts[0] must be a 1-dim sequence of integer token ids"),
    row("generate a negative id", lambda: generate(CountingLM(), [[-1]], 2), ValueError,
        "prompts must hold token ids >= 0, got -1"),
    row("generate a 1-dim tensor", lambda: generate(CountingLM(), torch.tensor([1, 2]), 2),
        ValueError, "prompts must have shape (B, L) (2 dims)"),
    row("generate temperature=-1", lambda: generate(CountingLM(), [[BOS]], 2, temperature=-1.0),
        ValueError, "temperature must be a finite number in [0.0, inf], got -1.0"),
    row("generate temperature=inf",
        lambda: generate(CountingLM(), [[BOS]], 2, temperature=math.inf), ValueError,
        "temperature"),
    row("generate generator=0",
        lambda: generate(CountingLM(), [[BOS]], 2, temperature=1.0, generator=0),
        InputTypeError, "generator must be a torch.Generator or None"),
    row("generate eos=2.0", lambda: generate(CountingLM(), [[BOS]], 2, eos=2.0), InputTypeError,
        "eos must be an int >= 0, got 2.0"),
    row("generate model not a module", lambda: generate(lambda t: t, [[BOS]], 2), InputTypeError,
        "model must be an nn.Module"),
    row("generate beyond max_len", lambda: generate(lm(max_len=8), [[BOS] * 6], 4), ValueError,
        "a prompt of 6 tokens and max_new_tokens=4 needs 9 positions but the model takes at "
        "most max_len=8"),
    row("generate a model giving (B, V)", lambda: generate(nn.Identity(), [[BOS]], 2), ValueError,
        "the model's output must have shape (B, L, V)"),
    row("greedy_decode max_len=0", lambda: greedy_decode(FakeSeq2Seq(), SRC, SRC_MASK, 0),
        ValueError, "max_len must be a positive int, got 0"),
    row("greedy_decode max_len=2.0", lambda: greedy_decode(FakeSeq2Seq(), SRC, SRC_MASK, 2.0),
        InputTypeError, "max_len must be a positive int, got 2.0"),
    row("greedy_decode float src",
        lambda: greedy_decode(FakeSeq2Seq(), SRC.float(), SRC_MASK, 2), InputTypeError,
        "src must hold integer token ids"),
    row("greedy_decode float src_mask",
        lambda: greedy_decode(FakeSeq2Seq(), SRC, SRC_MASK.float(), 2), InputTypeError,
        "src_mask must be a bool tensor"),
    row("greedy_decode src_mask on meta",
        lambda: greedy_decode(FakeSeq2Seq(), SRC, SRC_MASK.to("meta"), 2), InputTypeError,
        "src_mask is on meta but src is on cpu"),
    row("greedy_decode src_mask None", lambda: greedy_decode(FakeSeq2Seq(), SRC, None, 2),
        InputTypeError, "src_mask must be a torch.Tensor"),
    row("greedy_decode bos=1.0", lambda: greedy_decode(FakeSeq2Seq(), SRC, SRC_MASK, 2, bos=1.0),
        InputTypeError, "bos must be an int >= 0, got 1.0"),
    row("greedy_decode model not a module", lambda: greedy_decode(object(), SRC, SRC_MASK, 2),
        InputTypeError, "model must be an nn.Module with encode() and decode()"),
    row("greedy_decode beyond max_len", lambda: greedy_decode(s2s(), SRC, SRC_MASK, 17),
        ValueError, "max_len=17 needs 17 positions but the model takes at most max_len=16"),
    row("sample_decode temperature=nan",
        lambda: sample_decode(FakeSeq2Seq(), SRC, SRC_MASK, 2, temperature=math.nan),
        ValueError, "temperature"),
    row("next_token int logits", lambda: next_token(torch.tensor([[1, 2]])), InputTypeError,
        "logits must be a floating-point tensor"),
    row("next_token V=0", lambda: next_token(torch.zeros(2, 0)), ValueError,
        "at least one token (V >= 1)"),
    row("next_token NaN, greedy", lambda: next_token(torch.tensor([[math.nan, 1.0]])),
        ValueError, "logits must not contain NaN or +inf"),
    row("next_token +inf, sampling", lambda: next_token(torch.tensor([[math.inf, 1.0]]), 1.0),
        ValueError, "logits must not contain NaN or +inf"),
    row("next_token all -inf", lambda: next_token(torch.full((1, 3), -math.inf), 1.0),
        ValueError, "at least one finite score"),
    row("next_token temperature=True", lambda: next_token(torch.zeros(1, 3), True),
        InputTypeError, "temperature must be a real number"),
]

TRAINING = [
    row("train steps=0", lambda: train(lin(), endless(), seq_loss, steps=0), ValueError,
        "steps must be a positive int, got 0"),
    row("train steps=2.0", lambda: train(lin(), endless(), seq_loss, steps=2.0), InputTypeError,
        "steps must be a positive int, got 2.0"),
    row("train steps=True", lambda: train(lin(), endless(), seq_loss, steps=True),
        InputTypeError, "steps must be a positive int, got True"),
    row("train lr=0", lambda: train(lin(), endless(), seq_loss, steps=2, lr=0.0), ValueError,
        "lr must be a finite number in (0.0, inf], got 0.0"),
    row("train lr=nan", lambda: train(lin(), endless(), seq_loss, steps=2, lr=math.nan),
        ValueError, "lr must be a finite number"),
    row("train warmup > steps", lambda: train(lin(), endless(), seq_loss, steps=2, warmup=5),
        ValueError, "warmup must be at most steps=2, got 5"),
    row("train warmup=1.5", lambda: train(lin(), endless(), seq_loss, steps=2, warmup=1.5),
        InputTypeError, "warmup must be an int >= 0, got 1.5"),
    row("train report_every=0",
        lambda: train(lin(), endless(), seq_loss, steps=2, report_every=0), ValueError,
        "report_every must be a positive int, got 0"),
    row("train clip=0", lambda: train(lin(), endless(), seq_loss, steps=2, clip=0.0), ValueError,
        "clip must be a finite number in (0.0, inf]"),
    row("train seed=-1", lambda: train(lin(), endless(), seq_loss, steps=2, seed=-1), ValueError,
        "seed must be an int >= 0, got -1"),
    row("train decimals=1.5", lambda: train(lin(), endless(), seq_loss, steps=2, decimals=1.5),
        InputTypeError, "decimals must be an int >= 0"),
    row("train batches not iterable", lambda: train(lin(), 5, seq_loss, steps=2), InputTypeError,
        "batches must be an iterable of batches, got int"),
    row("train loss_fn None", lambda: train(lin(), endless(), None, steps=2), InputTypeError,
        "loss_fn must be callable"),
    row("train print_fn=1", lambda: train(lin(), endless(), seq_loss, steps=2, print_fn=1),
        InputTypeError, "print_fn must be callable or None"),
    row("train model a function", lambda: train(lambda b: b, endless(), seq_loss, steps=2),
        InputTypeError, "model must be an nn.Module"),
    row("train no trainable parameter",
        lambda: train(nn.ReLU(), endless(), lambda m, b: b.sum(), steps=2), ValueError,
        "model has no parameter with requires_grad=True"),
    row("train loss_fn returns a float",
        lambda: train(lin(), endless(), lambda m, b: 1.0, steps=2, print_fn=None),
        InputTypeError, "loss_fn must return a scalar torch.Tensor, got float"),
    row("train loss_fn returns a vector",
        lambda: train(lin(), endless(), lambda m, b: m(b), steps=2, print_fn=None), ValueError,
        "loss_fn must return a scalar, got shape (3, 1)"),
    row("train loss without grad",
        lambda: train(lin(), endless(), lambda m, b: torch.tensor(1.0), steps=2, print_fn=None),
        ValueError, "does not require grad"),
    row("train batches run out",
        lambda: train(lin(), [torch.ones(1, 2)], seq_loss, steps=3, print_fn=None), ValueError,
        "batches ran out after 1 of 3 steps"),
    row("warmup_linear_decay step=1.5", lambda: warmup_linear_decay(1.5, 1, 10), InputTypeError,
        "step must be an int >= 0, got 1.5"),
    row("warmup_linear_decay total=10.0", lambda: warmup_linear_decay(0, 1, 10.0),
        InputTypeError, "total must be a positive int, got 10.0"),
    row("warmup_linear_decay warmup > total", lambda: warmup_linear_decay(0, 11, 10), ValueError,
        "warmup=11, total=10"),
    row("token_cross_entropy every target is padding",
        lambda: token_cross_entropy(LOGITS, torch.zeros(2, 3, dtype=torch.long)), ValueError,
        "no position is scored"),
    row("token_cross_entropy empty batch",
        lambda: token_cross_entropy(torch.zeros(0, 3, 5), torch.zeros(0, 3, dtype=torch.long)),
        ValueError, "no position is scored"),
    row("token_cross_entropy int logits",
        lambda: token_cross_entropy(LOGITS.long(), TARGETS), InputTypeError,
        "logits must be a floating-point tensor"),
    row("token_cross_entropy float targets",
        lambda: token_cross_entropy(LOGITS, TARGETS.float()), InputTypeError,
        "targets must hold integer token ids"),
    row("token_cross_entropy target = V",
        lambda: token_cross_entropy(LOGITS, torch.tensor([[5, 1, 1], [1, 1, 1]])), ValueError,
        "must hold ids in [0, 5), got values from 1 to 5"),
    row("token_cross_entropy negative target",
        lambda: token_cross_entropy(LOGITS, torch.tensor([[-1, 1, 1], [1, 1, 1]])), ValueError,
        "must hold ids in [0, 5), got values from -1 to 1"),
    row("token_cross_entropy shapes differ", lambda: token_cross_entropy(LOGITS, TARGETS[:, :2]),
        ValueError, "targets must have shape (B, L) = (2, 3), got (2, 2)"),
    row("token_cross_entropy ignore_index=0.5",
        lambda: token_cross_entropy(LOGITS, TARGETS, 0.5), InputTypeError,
        "ignore_index must be an int, got 0.5"),
    row("token_cross_entropy targets on meta",
        lambda: token_cross_entropy(LOGITS, TARGETS.to("meta")), InputTypeError,
        "targets is on meta but logits is on cpu"),
    row("token_accuracy every target is padding",
        lambda: token_accuracy(LOGITS, torch.zeros(2, 3, dtype=torch.long)), ValueError,
        "no position is scored"),
    row("token_accuracy bool targets", lambda: token_accuracy(LOGITS, TARGETS > 0),
        InputTypeError, "targets must hold integer token ids"),
    row("token_accuracy target = V",
        lambda: token_accuracy(LOGITS, torch.tensor([[5, 1, 1], [1, 1, 1]])), ValueError,
        "[0, 5)"),
    row("exact_match lengths differ", lambda: exact_match([[1]], [[1], [2]]), ValueError,
        "got 1 predictions for 2 expected sequences"),
    row("exact_match nothing", lambda: exact_match([], []), ValueError, "at least one sequence"),
    row("exact_match flat lists", lambda: exact_match([1, 2], [1, 2]), InputTypeError,
        "predicted[0] is int"),
    row("exact_match a generator", lambda: exact_match((p for p in [[1]]), [[1]]),
        InputTypeError, "predicted must be a list of sequences"),
]

DATA = [
    row("ReversalTask min_len > max_len", lambda: ReversalTask(min_len=6, max_len=5), ValueError,
        "max_len must be >= min_len=6, got 5"),
    row("ReversalTask num_symbols=1", lambda: ReversalTask(num_symbols=1), ValueError,
        "num_symbols must be an int >= 2, got 1"),
    row("ReversalTask num_symbols=27", lambda: ReversalTask(num_symbols=27), ValueError,
        "num_symbols must be at most 26, got 27"),
    row("ReversalTask num_symbols=10.0", lambda: ReversalTask(num_symbols=10.0), InputTypeError,
        "num_symbols must be an int >= 2, got 10.0"),
    row("SortingTask min_len=2.0", lambda: SortingTask(min_len=2.0), InputTypeError,
        "min_len must be a positive int, got 2.0"),
    row("SortingTask num_digits=11", lambda: SortingTask(num_digits=11), ValueError,
        "num_digits must be at most 10"),
    row("SortingTask distinct=1", lambda: SortingTask(distinct=1), InputTypeError,
        "distinct must be True or False"),
    row("MissingDigitTask min_len=1", lambda: MissingDigitTask(min_len=1, max_len=4), ValueError,
        "min_len must be an int >= 2, got 1"),
    row("MissingDigitTask max_len=11", lambda: MissingDigitTask(max_len=11), ValueError,
        "max_len must be at most 10"),
    row("sample n=0", lambda: ReversalTask().sample(0, seed=0), ValueError,
        "n must be a positive int, got 0"),
    row("sample n=2.0", lambda: SortingTask().sample(2.0, seed=0), InputTypeError,
        "n must be a positive int, got 2.0"),
    row("sample n=True", lambda: MissingDigitTask().sample(True, seed=0), InputTypeError,
        "n must be a positive int, got True"),
    row("sample seed=1.5", lambda: ReversalTask().sample(2, seed=1.5), InputTypeError,
        "seed must be an int >= 0, got 1.5"),
    row("sample exclude=5", lambda: ReversalTask().sample(2, seed=0, exclude=5), InputTypeError,
        "exclude must be a list of examples"),
    row("sample more than the task has", lambda: ReversalTask(1, 1, 2).sample(5, seed=0),
        ValueError, "too small"),
    row("batches batch_size=0, at the call", lambda: ReversalTask().batches(0, seed=0),
        ValueError, "batch_size must be a positive int, got 0"),
    row("batches pad_to=-1, at the call", lambda: SortingTask().batches(2, seed=0, pad_to=-1),
        ValueError, "pad_to must be an int >= 0, got -1"),
    row("batches seed=-1, at the call", lambda: MissingDigitTask().batches(2, seed=-1),
        ValueError, "seed must be an int >= 0, got -1"),
    row("ReversalTask.collate([])", lambda: ReversalTask().collate([]), ValueError,
        "examples must hold at least one example, got none"),
    row("SortingTask.collate([])", lambda: SortingTask().collate([]), ValueError,
        "at least one example"),
    row("MissingDigitTask.collate([])", lambda: MissingDigitTask().collate([]), ValueError,
        "at least one example"),
    row("collate non-pairs", lambda: ReversalTask().collate([1, 2]), InputTypeError,
        "examples[0] is int"),
    row("collate pad_to=1.5", lambda: SortingTask().collate([((1, 3), (4,))], pad_to=1.5),
        InputTypeError, "pad_to must be an int >= 0, got 1.5"),
    row("MissingDigitTask.collate unequal lengths",
        lambda: MissingDigitTask().collate([((3, 4), (PAD,))]), ValueError,
        "examples[0] has 2 inputs but 1 targets"),
    row("Seq2SeqBatch.from_pairs([])", lambda: Seq2SeqBatch.from_pairs([]), ValueError,
        "at least one example"),
    row("Vocab.decode id = len", lambda: Vocab.from_symbols("ab").decode([5]), ValueError,
        "id 5 is outside the vocabulary of size 5"),
    row("Vocab.decode id -1", lambda: Vocab.from_symbols("ab").decode([-1]), ValueError,
        "outside the vocabulary"),
    row("Vocab.decode 2.7", lambda: Vocab.from_symbols("ab").decode([3, 2.7]), InputTypeError,
        "ids must be integers, got 2.7"),
    row("Vocab.decode True", lambda: Vocab.from_symbols("ab").decode([True]), InputTypeError,
        "ids must be integers, got True"),
    row("Vocab.decode float tensor",
        lambda: Vocab.from_symbols("ab").decode(torch.tensor([3.0])), InputTypeError,
        "integer token ids"),
    row("Vocab.decode 2-d tensor",
        lambda: Vocab.from_symbols("ab").decode(torch.tensor([[3, 4]])), InputTypeError,
        "1-dim sequence"),
    row("Vocab.encode a string", lambda: Vocab.from_symbols("ab").encode("ab"), InputTypeError,
        "tokens must be an iterable of token strings (e.g. text.split()), got str"),
    row("Vocab.encode an int token", lambda: Vocab.from_symbols("ab").encode([3]),
        InputTypeError, "every token must be a str, got 3"),
    row("Vocab with a non-string token", lambda: Vocab(("<pad>", "<bos>", "<eos>", 1)),
        InputTypeError, "every token must be a str"),
    row("pad_sequences([])", lambda: pad_sequences([]), ValueError, "at least one sequence"),
    row("pad_sequences empty sequence", lambda: pad_sequences([[1], []]), ValueError,
        "every sequence must be non-empty, got lengths [1, 0]"),
    row("pad_sequences floats", lambda: pad_sequences([[1.5, 2]]), InputTypeError,
        "seqs[0] must be a 1-dim sequence of integer token ids"),
    row("pad_sequences bools", lambda: pad_sequences([[True, False]]), InputTypeError,
        "seqs[0] must be a 1-dim sequence of integer token ids"),
    row("pad_sequences flat list", lambda: pad_sequences([1, 2]), InputTypeError,
        "seqs[0] must be a 1-dim sequence of integer token ids, got int"),
    row("pad_sequences pad=0.5", lambda: pad_sequences([[1]], pad=0.5), InputTypeError,
        "pad must be an int, got 0.5"),
    row("pad_sequences max_len=1.5", lambda: pad_sequences([[1]], max_len=1.5), InputTypeError,
        "max_len must be a positive int"),
    row("pad_sequences pad_to=-1", lambda: pad_sequences([[1]], pad_to=-1), ValueError,
        "pad_to must be an int >= 0, got -1"),
]


@pytest.mark.parametrize("call,exc,phrase",
                         CONSTRUCTORS + FORWARD + COUNTS + DECODING + TRAINING + DATA)
def test_bad_input_raises_a_clear_error(call, exc, phrase):
    with pytest.raises(exc) as info:
        call()
    assert phrase in str(info.value)
    # Wrong type, dtype or device: both kinds, so that `except ValueError` still catches it.
    assert isinstance(info.value, ValueError)
    if exc is InputTypeError:
        assert isinstance(info.value, TypeError)


# ---------------------------------------------------------------------------------------------
# Bad arguments are refused before any work: the model is never called
# ---------------------------------------------------------------------------------------------

NO_WORK = [
    pytest.param(lambda m: generate(m, [[BOS]], 0), CountingLM, id="generate max_new_tokens"),
    pytest.param(lambda m: generate(m, [[BOS]], 2, temperature=-1.0), CountingLM,
                 id="generate temperature"),
    pytest.param(lambda m: generate(m, [[BOS], [1.5]], 2), CountingLM, id="generate float id"),
    pytest.param(lambda m: generate(m, [[BOS], []], 2), CountingLM, id="generate empty prompt"),
    pytest.param(lambda m: greedy_decode(m, SRC, SRC_MASK, 2, eos=-1), FakeSeq2Seq,
                 id="greedy_decode eos"),
    pytest.param(lambda m: sample_decode(m, SRC, SRC_MASK, 2, generator="seed"), FakeSeq2Seq,
                 id="sample_decode generator"),
]


@pytest.mark.parametrize("call,make", NO_WORK)
def test_bad_decoding_arguments_never_reach_the_model(call, make):
    model = make()
    with pytest.raises(ValueError):
        call(model)
    assert model.calls == 0


def test_bad_training_arguments_change_nothing():
    model = lin().eval()
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def loss_fn(m, b):
        calls.append(1)
        return seq_loss(m, b)

    with pytest.raises(ValueError, match="warmup"):
        train(model, endless(), loss_fn, steps=2, warmup=3)
    assert calls == [] and not model.training
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# ---------------------------------------------------------------------------------------------
# Degenerate but valid input: the defined result, asserted
# ---------------------------------------------------------------------------------------------

def _masked_encoder_layer_output() -> tuple[torch.Tensor, torch.Tensor]:
    """A post-LN layer whose keys are all masked: attention gives its output bias b_O."""
    layer = enc_layer()
    out = layer(X, torch.zeros(2, 5, dtype=BOOL))
    h = layer.norm1(X + layer.self_attn.w_o.bias)
    return out, layer.norm2(h + layer.ff(h))


def _decoder_layer_empty_memory() -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-attention over an empty memory gives its output bias b_O."""
    layer = dec_layer()
    out = layer(X, torch.randn(2, 0, D))
    ref = layer.norm1(X + layer.self_attn(X, X, X))
    ref = layer.norm2(ref + layer.cross_attn.w_o.bias)
    return out, layer.norm3(ref + layer.ff(ref))


def _shape(shape):
    return lambda out: tuple(out.shape) == shape and bool(torch.isfinite(out).all())


def _equal(expected):
    return lambda out: out == expected


DEGENERATE = [
    pytest.param(lambda: enc_layer()(torch.randn(0, 5, D)), _shape((0, 5, D)),
                 id="EncoderLayer B=0"),
    pytest.param(lambda: encoder()(torch.randn(2, 0, D), torch.ones(2, 0, dtype=BOOL)),
                 _shape((2, 0, D)), id="Encoder L=0 with a mask"),
    pytest.param(lambda: decoder()(torch.randn(0, 5, D), torch.randn(0, 3, D)),
                 _shape((0, 5, D)), id="Decoder B=0"),
    pytest.param(lambda: decoder()(torch.randn(2, 0, D), MEM), _shape((2, 0, D)),
                 id="Decoder L_t=0"),
    pytest.param(lambda: transformer()(torch.randn(2, 0, D), X), _shape((2, 5, D)),
                 id="Transformer L_s=0: finite"),
    pytest.param(lambda: transformer()(MEM, X, torch.zeros(2, 3, dtype=BOOL), None,
                                       torch.zeros(2, 3, dtype=BOOL)),
                 _shape((2, 5, D)), id="Transformer every source key masked: finite"),
    pytest.param(lambda: encoder()(X, padding_mask([5, 0], 5)), _shape((2, 5, D)),
                 id="Encoder one row all padding: finite"),
    pytest.param(lambda: torch.allclose(*_masked_encoder_layer_output(), atol=1e-6),
                 _equal(True), id="EncoderLayer every key masked: b_O"),
    pytest.param(lambda: torch.allclose(*_decoder_layer_empty_memory(), atol=1e-6),
                 _equal(True), id="DecoderLayer empty memory: b_O"),
    pytest.param(lambda: lm()(torch.zeros(2, 0, dtype=torch.long)), _shape((2, 0, V)),
                 id="DecoderOnlyLM L=0"),
    pytest.param(lambda: mlm()(torch.zeros(0, 3, dtype=torch.long)), _shape((0, 3, V)),
                 id="EncoderOnlyMLM B=0"),
    pytest.param(lambda: mlm()(TOK, torch.tensor([[True] * 3, [False] * 3])), _shape((2, 3, V)),
                 id="EncoderOnlyMLM a row all padding: finite"),
    pytest.param(lambda: s2s()(TOK, torch.zeros(2, 0, dtype=torch.long)), _shape((2, 0, V)),
                 id="Seq2Seq L_t=0"),
    pytest.param(lambda: InputEmbedding(V, D)(torch.zeros(0, 3, dtype=torch.long)),
                 _shape((0, 3, D)), id="InputEmbedding B=0"),
    pytest.param(lambda: generate(CountingLM(), [], 3), _equal([]), id="generate no prompts"),
    pytest.param(lambda: generate(CountingLM(), torch.tensor([[1, 3]]), 3), _equal([[4, 5, 6]]),
                 id="generate a (B, L) tensor of prompts"),
    pytest.param(lambda: generate(CountingLM(), [np.array([1, 3]), (7,)], 3),
                 _equal([[4, 5, 6], [8, 9]]), id="generate NumPy and tuple prompts"),
    pytest.param(lambda: len(generate(lm(max_len=8), [[BOS] * 6], 3)[0]) <= 3, _equal(True),
                 id="generate exactly up to max_len"),
    pytest.param(lambda: greedy_decode(FakeSeq2Seq(), torch.zeros(0, 2, dtype=torch.long),
                                       torch.zeros(0, 2, dtype=BOOL), 3),
                 _equal([]), id="greedy_decode B=0"),
    pytest.param(lambda: next_token(torch.zeros(0, 3)).shape, _equal((0,)), id="next_token B=0"),
    pytest.param(lambda: next_token(torch.tensor([[-math.inf, 0.0, -math.inf]] * 50), 1.0,
                                    torch.Generator().manual_seed(0)).tolist(),
                 _equal([1] * 50), id="next_token -inf never sampled"),
    pytest.param(lambda: token_cross_entropy(LOGITS, torch.tensor([[3, 4, -100], [1, -100, -100]]),
                                             -100).item(),
                 _equal(F.cross_entropy(LOGITS.reshape(-1, 5),
                                        torch.tensor([3, 4, -100, 1, -100, -100])).item()),
                 id="token_cross_entropy ignore_index=-100"),
    pytest.param(lambda: token_cross_entropy(LOGITS, TARGETS.int()).item(),
                 _equal(token_cross_entropy(LOGITS, TARGETS).item()),
                 id="token_cross_entropy int32 targets"),
    pytest.param(lambda: token_accuracy(torch.eye(5)[None, [3, 1, 0]] * 1.0,
                                        torch.tensor([[3, 4, PAD]])),
                 _equal(0.5), id="token_accuracy half right"),
    pytest.param(lambda: exact_match([[1, 2], [3]], [[1, 2], [3, 4]]), _equal(0.5),
                 id="exact_match"),
    pytest.param(lambda: exact_match(torch.tensor([[1, 2]]), [[1, 2]]), _equal(1.0),
                 id="exact_match tensor rows"),
    pytest.param(lambda: exact_match([np.array([1, 2]), (3,)], [[1, 2], [3]]), _equal(1.0),
                 id="exact_match NumPy rows"),
    pytest.param(lambda: warmup_linear_decay(0, 0, 10), _equal(1.0), id="no warm-up"),
    pytest.param(lambda: warmup_linear_decay(12, 1, 10), _equal(0.0), id="after the end"),
    pytest.param(lambda: costs.count_parameters(nn.ReLU()), _equal(0), id="count_parameters none"),
    pytest.param(lambda: costs.transformer_param_count(8, 2, 16, 0, 0), _equal(2 * 2 * 8),
                 id="param_count no layers: the two final norms"),
    pytest.param(lambda: Vocab.from_symbols("ab").decode([]), _equal(""), id="decode nothing"),
    pytest.param(lambda: Vocab.from_symbols("ab").encode([]), _equal([]), id="encode nothing"),
    pytest.param(lambda: pad_sequences([[1], [1, 2]], pad=-100)[0].tolist(),
                 _equal([[1, -100], [1, 2]]), id="pad_sequences pad=-100"),
]


@pytest.mark.parametrize("call,check", DEGENERATE)
def test_degenerate_input_gives_its_defined_result(call, check):
    assert check(call())


# ---------------------------------------------------------------------------------------------
# from_torch: refuse what cannot be copied exactly, copy exactly what is accepted
# ---------------------------------------------------------------------------------------------

def tel(**kw) -> nn.TransformerEncoderLayer:
    kw = {"batch_first": True, "dropout": 0.0, **kw}
    return nn.TransformerEncoderLayer(D, H, FF, **kw)


def tdl(**kw) -> nn.TransformerDecoderLayer:
    kw = {"batch_first": True, "dropout": 0.0, **kw}
    return nn.TransformerDecoderLayer(D, H, FF, **kw)


def tenc(n: int = 2, norm: bool = True, layer=None, **kw) -> nn.TransformerEncoder:
    return nn.TransformerEncoder(layer or tel(), n, norm=nn.LayerNorm(D) if norm else None, **kw)


def tdec(n: int = 2, norm: bool = True, layer=None) -> nn.TransformerDecoder:
    return nn.TransformerDecoder(layer or tdl(), n, norm=nn.LayerNorm(D) if norm else None)


def changed(module: nn.Module, fn) -> nn.Module:
    """``module`` after ``fn(module)``: a torch module edited after it was built."""
    fn(module)
    return module


REFUSED = [
    row("EncoderLayer from a Linear", lambda: EncoderLayer.from_torch(nn.Linear(4, 4)),
        InputTypeError, "module must be an nn.TransformerEncoderLayer, got Linear"),
    row("DecoderLayer from an encoder layer", lambda: DecoderLayer.from_torch(tel()),
        InputTypeError, "nn.TransformerDecoderLayer"),
    row("EncoderLayer batch_first=False",
        lambda: EncoderLayer.from_torch(tel(batch_first=False)), ValueError,
        "batch_first=False"),
    row("DecoderLayer batch_first=False",
        lambda: DecoderLayer.from_torch(tdl(batch_first=False)), ValueError,
        "batch_first=False"),
    row("EncoderLayer tanh activation",
        lambda: EncoderLayer.from_torch(tel(activation=torch.tanh)), ValueError,
        "activation must be relu or the exact gelu"),
    row("EncoderLayer approximate gelu",
        lambda: EncoderLayer.from_torch(tel(activation=nn.GELU(approximate="tanh"))), ValueError,
        "approximate='none'"),
    row("EncoderLayer activation swapped after construction",
        lambda: EncoderLayer.from_torch(changed(tel(), lambda m: setattr(m, "activation",
                                                                           F.gelu))),
        ValueError, "activation_relu_or_gelu=1"),
    row("EncoderLayer bias=False", lambda: EncoderLayer.from_torch(tel(bias=False)), ValueError,
        "bias=False"),
    row("DecoderLayer bias=False", lambda: DecoderLayer.from_torch(tdl(bias=False)), ValueError,
        "bias=False"),
    row("EncoderLayer linear1 bias removed",
        lambda: EncoderLayer.from_torch(changed(tel(), lambda m: setattr(m.linear1, "bias",
                                                                           None))),
        ValueError, "module.linear1 has no bias"),
    row("EncoderLayer out_proj bias removed",
        lambda: EncoderLayer.from_torch(changed(tel(), lambda m: setattr(
            m.self_attn.out_proj, "bias", None))),
        ValueError, "module.self_attn has no bias"),
    row("EncoderLayer norm without affine",
        lambda: EncoderLayer.from_torch(changed(tel(), lambda m: setattr(
            m, "norm1", nn.LayerNorm(D, elementwise_affine=False)))),
        ValueError, "module.norm1 has no gain and bias (elementwise_affine=False)"),
    row("EncoderLayer norm bias=False",
        lambda: EncoderLayer.from_torch(changed(tel(), lambda m: setattr(
            m, "norm2", nn.LayerNorm(D, bias=False)))),
        ValueError, "module.norm2 has no bias"),
    row("EncoderLayer RMSNorm", lambda: EncoderLayer.from_torch(changed(tel(), lambda m: setattr(
        m, "norm1", nn.RMSNorm(D)))), InputTypeError, "module.norm1 must be an nn.LayerNorm"),
    row("EncoderLayer eps differ",
        lambda: EncoderLayer.from_torch(changed(tel(), lambda m: setattr(m.norm2, "eps", 1e-3))),
        ValueError, "module.norm1.eps=1e-05, module.norm2.eps=0.001"),
    row("DecoderLayer norm3 eps differs",
        lambda: DecoderLayer.from_torch(changed(tdl(), lambda m: setattr(m.norm3, "eps", 1e-3))),
        ValueError, "module.norm3.eps=0.001"),
    row("EncoderLayer dropouts differ",
        lambda: EncoderLayer.from_torch(changed(tel(), lambda m: setattr(m.dropout1, "p", 0.3))),
        ValueError, "the dropout probability must be the same everywhere"),
    row("DecoderLayer heads differ",
        lambda: DecoderLayer.from_torch(changed(tdl(), lambda m: setattr(
            m, "multihead_attn", nn.MultiheadAttention(D, 4, batch_first=True)))),
        ValueError, "module.self_attn.num_heads=2, module.multihead_attn.num_heads=4"),
    row("EncoderLayer kdim",
        lambda: EncoderLayer.from_torch(changed(tel(), lambda m: setattr(
            m, "self_attn", nn.MultiheadAttention(D, H, kdim=4, vdim=4, batch_first=True)))),
        ValueError, "kdim/vdim"),
    row("EncoderLayer add_bias_kv",
        lambda: EncoderLayer.from_torch(changed(tel(), lambda m: setattr(
            m, "self_attn", nn.MultiheadAttention(D, H, add_bias_kv=True, batch_first=True)))),
        ValueError, "add_bias_kv"),
    row("EncoderLayer mixed dtypes",
        lambda: EncoderLayer.from_torch(changed(tel(), lambda m: m.linear2.double())),
        InputTypeError, "mix dtypes or devices"),
    row("Encoder from a layer", lambda: Encoder.from_torch(tel()), InputTypeError,
        "module must be an nn.TransformerEncoder, got TransformerEncoderLayer"),
    row("Decoder with no layers", lambda: Decoder.from_torch(tdec(0)), ValueError, "no layers"),
    row("Encoder layers differ in d_ff",
        lambda: Encoder.from_torch(changed(tenc(), lambda m: m.layers.__setitem__(
            1, nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=True)))),
        ValueError, "module.layers[1] has dim_feedforward=32 but module.layers[0] has 16"),
    row("Encoder layers differ in norm_first",
        lambda: Encoder.from_torch(changed(tenc(), lambda m: setattr(m.layers[1], "norm_first",
                                                                      True))),
        ValueError, "module.layers[1] has norm_first=True"),
    row("Decoder layers differ in eps",
        lambda: Decoder.from_torch(changed(tdec(), lambda m: [setattr(n, "eps", 1e-3) for n in (
            m.layers[1].norm1, m.layers[1].norm2, m.layers[1].norm3)])),
        ValueError, "module.layers[1] has layer_norm_eps=0.001"),
    row("Encoder layers share parameters",
        lambda: Encoder.from_torch(changed(tenc(), lambda m: m.layers.__setitem__(1,
                                                                                  m.layers[0]))),
        ValueError, "share parameters"),
    row("Encoder a layer of another kind",
        lambda: Encoder.from_torch(changed(tenc(), lambda m: m.layers.__setitem__(
            1, nn.Linear(D, D)))),
        InputTypeError, "module.layers[1] must be an nn.TransformerEncoderLayer"),
    row("Encoder final RMSNorm",
        lambda: Encoder.from_torch(changed(tenc(), lambda m: setattr(m, "norm", nn.RMSNorm(D)))),
        InputTypeError, "module.norm must be an nn.LayerNorm, got RMSNorm"),
    row("Encoder final norm of another eps",
        lambda: Encoder.from_torch(changed(tenc(), lambda m: setattr(m.norm, "eps", 1e-3))),
        ValueError, "module.norm.eps=0.001"),
    row("Encoder nested tensors with mask_check=False",
        lambda: Encoder.from_torch(tenc(mask_check=False)), ValueError, "mask_check=False"),
    row("Transformer from an encoder", lambda: Transformer.from_torch(tenc()), InputTypeError,
        "module must be an nn.Transformer"),
    row("Transformer batch_first=False",
        lambda: Transformer.from_torch(nn.Transformer(D, H, 1, 1, FF)), ValueError,
        "batch_first=False"),
    row("Transformer encoder and decoder differ",
        lambda: Transformer.from_torch(nn.Transformer(
            D, H, 1, 1, FF, batch_first=True, custom_decoder=tdec(
                1, layer=nn.TransformerDecoderLayer(D, H, 32, batch_first=True)))),
        ValueError, "module.encoder has dim_feedforward=16 but module.decoder has 32"),
    row("Transformer decoder without a final norm",
        lambda: Transformer.from_torch(nn.Transformer(D, H, 1, 1, FF, batch_first=True,
                                                      custom_decoder=tdec(1, norm=False))),
        ValueError, "module.decoder has no final norm"),
    row("Transformer custom encoder of another kind",
        lambda: Transformer.from_torch(nn.Transformer(D, H, 1, 1, FF, batch_first=True,
                                                      custom_encoder=nn.Linear(D, D))),
        InputTypeError, "module.encoder must be an nn.TransformerEncoder"),
]


@pytest.mark.parametrize("call,exc,phrase", REFUSED)
def test_from_torch_refuses_what_it_cannot_copy(call, exc, phrase):
    with pytest.raises(exc) as info:
        call()
    assert phrase in str(info.value)


F64 = {"dtype": torch.float64}
X64, MEM64 = X.double(), MEM.double()

ACCEPTED = [
    pytest.param(EncoderLayer, lambda act=act, nf=nf: tel(activation=act, norm_first=nf,
                                                         layer_norm_eps=1e-6, **F64),
                 (X64,), id=f"EncoderLayer-{name}-nf{nf}")
    for name, act in (("relu", "relu"), ("gelu", "gelu"), ("nn.GELU", nn.GELU()),
                      ("nn.ReLU", nn.ReLU()), ("torch.relu", torch.relu))
    for nf in (False, True)
] + [
    pytest.param(DecoderLayer, lambda act=act, nf=nf: tdl(activation=act, norm_first=nf,
                                                         dropout=0.1, **F64),
                 (X64, MEM64), id=f"DecoderLayer-{act}-nf{nf}")
    for act in ("relu", "gelu") for nf in (False, True)
] + [
    pytest.param(Encoder, lambda: tenc(layer=tel(**F64), norm=False), (X64,),
                 id="Encoder no final norm"),
    pytest.param(Encoder, lambda: nn.TransformerEncoder(tel(**F64), 2, norm=nn.LayerNorm(D, **F64)),
                 (X64,), id="Encoder nested tensors on"),
    pytest.param(Encoder, lambda: nn.TransformerEncoder(
        tel(norm_first=True, **F64), 2, norm=nn.LayerNorm(D, **F64), enable_nested_tensor=False,
        mask_check=False), (X64,), id="Encoder nested off, mask_check=False"),
    pytest.param(Decoder, lambda: nn.TransformerDecoder(tdl(**F64), 2,
                                                        norm=nn.LayerNorm(D, **F64)),
                 (X64, MEM64), id="Decoder"),
    pytest.param(Transformer, lambda: nn.Transformer(D, H, 2, 1, FF, dropout=0.0,
                                                     batch_first=True, **F64),
                 (MEM64, X64), id="Transformer post-LN"),
    pytest.param(Transformer, lambda: nn.Transformer(D, H, 1, 2, FF, dropout=0.1,
                                                     activation="gelu", norm_first=True,
                                                     batch_first=True, **F64),
                 (MEM64, X64), id="Transformer pre-LN gelu"),
]


@pytest.mark.parametrize("cls,make,inputs", ACCEPTED)
def test_from_torch_copies_exactly_what_it_accepts(cls, make, inputs):
    torch.manual_seed(0)
    ref = make().eval()
    ours = cls.from_torch(ref)
    assert type(ours) is cls and not ours.training
    assert all(p.dtype == torch.float64 for p in ours.parameters())
    with torch.enable_grad():  # torch's slow path: every position computed
        diff = (ref(*inputs) - ours(*inputs)).abs().max().item()
    assert diff < 1e-12  # float64: the same parameters, only summation order differs
    ref.train()
    assert cls.from_torch(ref).training


# ---------------------------------------------------------------------------------------------
# Modes and grad mode are restored on every exit path
# ---------------------------------------------------------------------------------------------

class Exploding(nn.Module):
    """A model that fails on its second call, with one submodule in eval mode while it trains."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
        self.calls = 0

    def forward(self, tokens):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("the model broke midway")
        return torch.zeros(tokens.shape[0], tokens.shape[1], 12)

    def encode(self, src, src_mask):
        return torch.zeros(src.shape[0], src.shape[1], 4)

    def decode(self, tgt, memory, src_mask):
        return self(tgt)


RUNS = [
    pytest.param(lambda m: generate(m, [[BOS, 3]], 5), id="generate"),
    pytest.param(lambda m: greedy_decode(m, SRC, SRC_MASK, 5), id="greedy_decode"),
    pytest.param(lambda m: sample_decode(m, SRC, SRC_MASK, 5, temperature=1.0),
                 id="sample_decode"),
]


@pytest.mark.parametrize("grad", [True, False], ids=["grad-on", "grad-off"])
@pytest.mark.parametrize("call", RUNS)
def test_decoding_restores_modes_when_the_model_fails(call, grad):
    model = Exploding().train()
    model.inner[1].eval()
    before = [m.training for m in model.modules()]
    with torch.set_grad_enabled(grad):
        with pytest.raises(RuntimeError, match="broke midway"):
            call(model)
        assert torch.is_grad_enabled() is grad
    assert model.calls == 2
    assert [m.training for m in model.modules()] == before == [True, True, True, False]


@pytest.mark.parametrize("call", RUNS)
def test_decoding_restores_modes_when_it_succeeds(call):
    model = Exploding().train()
    model.inner[1].eval()
    model.calls = -100
    call(model)
    assert [m.training for m in model.modules()] == [True, True, True, False]


def test_train_restores_modes_when_the_loss_fails():
    model = nn.Sequential(nn.Linear(2, 1), nn.Dropout(0.1)).eval()
    model[1].train()

    def loss_fn(m, batch):
        if loss_fn.calls == 1:
            raise RuntimeError("the loss broke midway")
        loss_fn.calls += 1
        return seq_loss(m, batch)

    loss_fn.calls = 0
    with pytest.raises(RuntimeError, match="broke midway"):
        train(model, endless(), loss_fn, steps=3, print_fn=None)
    assert [m.training for m in model.modules()] == [False, False, True]


def test_train_restores_modes_when_batches_run_out():
    model = lin().eval()
    with pytest.raises(ValueError, match="ran out"):
        train(model, [torch.ones(1, 2)], seq_loss, steps=2, print_fn=None)
    assert not model.training


def test_train_works_under_no_grad_and_leaves_it_off():
    model = lin()
    before = model.weight.detach().clone()
    with torch.no_grad():
        history = train(model, endless(), seq_loss, steps=2, print_fn=None)
        assert not torch.is_grad_enabled()
    assert len(history.step_losses) == 2 and not model.training
    assert not torch.equal(before, model.weight)
