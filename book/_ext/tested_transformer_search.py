"""The HTML book's search: a chapter first for its key terms, snippets of prose.

Loaded by ``tested_transformer_sphinx``. Sphinx's search page (searchtools.js)
scores a page that only mentions a word at 5, one with the word in a heading at
15, and one with an index entry that the query matches at up to 100 (an exact
match). Chapters 10 to 13 have headings with "mask" in them, as chapter 4 has,
and a tie is broken by comparing the titles as text, where "10." comes before
"4.": searching "masking" listed chapter 4 sixth.

- ``KEY_TERMS``: the search's key terms, the words a reader would type for each
  chapter's topic. Each is added to the search index as an entry at the top of
  its chapter in the HTML build, once the pages are read, so that it reaches the
  search and not the printed index (the glossary's): searching for exactly that
  term lists the chapter first (a chapter before the glossary's entry for the
  same term). A term names one chapter (a mention elsewhere does not count); a
  document missing from the book is a warning, so a renamed chapter fails ``-W``.
- ``tested_transformer_scorer.js`` (html_search_scorer): only an exact key term
  scores high; an entry that merely contains the query scores as a heading does,
  and results of equal score come in the book's order, chapter 4 before 10.
- ``tested-transformer-search.js``, on the search page only: each result's
  snippet is the prose around the query's words, inline formulas written as
  text, instead of the start of the page (its download menu, "....ipynb") or
  raw LaTeX.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.util import logging

logger = logging.getLogger(__name__)

SEARCH_SCRIPT = "tested-transformer-search.js"
SCORER = "tested_transformer_scorer.js"  # beside this file: html_search_scorer

# Each chapter's key terms, comma-separated, lower case as the search compares them.
# A query finds an entry that holds it and is at most twice its length: "rotary" finds
# "rotary" but not "rotary position embedding", so short terms are listed too.
KEY_TERMS: dict[str, str] = {
    "book/01_attention": "attention, scaled dot-product attention, softmax",
    "book/02_self_attention": "self-attention, query key value",
    "book/03_multi_head_attention": (
        "multi-head attention, heads, grouped-query attention, multi-query attention"
    ),
    "book/04_masking": "masking, mask, masks, causal mask, padding mask",
    "book/05_positional_encoding": (
        "positional encoding, sinusoidal, rotary, rope, position embedding"
    ),
    "book/06_feed_forward": "feed-forward, ffn, gelu, swiglu, mixture of experts",
    "book/07_layer_norm_and_residuals": (
        "layer norm, layer normalization, layernorm, rmsnorm, residual connection, "
        "pre-ln, post-ln"
    ),
    "book/08_encoder": "encoder, encoder layer",
    "book/09_transformer": (
        "decoder, decoder layer, encoder-decoder, cross-attention, teacher forcing, "
        "label smoothing"
    ),
    "book/10_model_families": "decoder-only, encoder-only, bert, gpt, language model",
    "book/11_attention_beyond_text": "graph, graphs, sound, audio, recurrence, rnn",
    "book/12_images_and_convolution": (
        "vision transformer, vit, images, patches, convolution"
    ),
    "book/13_fast_attention": (
        "kv cache, key/value cache, flash attention, memory-efficient attention, "
        "online softmax, prefill"
    ),
    "book/14_real_models": "gpt-2, llama, checkpoint, pretrained",
    "book/15_tokens_and_real_text": (
        "tokenizer, tokenization, bpe, byte-pair encoding, tokens"
    ),
    "book/16_beyond_one_machine": (
        "ring attention, data parallelism, tensor parallelism, fsdp, distributed"
    ),
    "book/17_devices_and_precision": (
        "bfloat16, float16, mixed precision, autocast, loss scaling, cuda graphs"
    ),
    "book/18_choosing_the_next_token": (
        "top-p, nucleus sampling, top-k, min-p, beam search, repetition penalty, "
        "sampling"
    ),
    "book/19_fine_tuning": (
        "fine-tuning, instruction tuning, classification head, answer-only loss"
    ),
    "book/20_lora_and_preferences": "lora, low-rank adaptation, dpo, preference tuning",
    "book/21_published_checkpoints": (
        "sharded checkpoint, shards, rope scaling, sliding-window attention, "
        "sliding window, mistral, qwen, gemma, sentencepiece, chat template"
    ),
}


def _add_key_terms(app, doctree: nodes.document, docname: str) -> None:
    """The chapter's key terms, main index entries at its top (HTML search only)."""
    terms = app.config.search_key_terms.get(docname)
    if not terms or app.builder.format != "html":
        return
    # (type, value, target id, main, category key); no target: a result opens the page.
    entries = [("single", t, "", "main", None) for t in terms.split(", ")]
    doctree.insert(0, addnodes.index(entries=entries, inline=False))


def _check_key_terms(app, env) -> None:
    for docname in sorted(set(app.config.search_key_terms) - env.found_docs):
        logger.warning(f"search key terms name {docname!r}, which is not in the book")


def _search_page_script(app, pagename, templatename, context, doctree) -> None:
    if pagename == "search":
        # Deferred: it runs after searchtools.js and before the search starts (on
        # DOMContentLoaded), so the snippet function it replaces is there to replace.
        app.add_js_file(SEARCH_SCRIPT, defer="defer")


def _use_the_scorer(app, config) -> None:
    if not config.html_search_scorer:
        config.html_search_scorer = str(Path(__file__).with_name(SCORER))


def setup(app) -> dict[str, Any]:
    # A setting, so that a change to the table rebuilds every page of the HTML book (an
    # edit of this file alone does not make Sphinx write the pages again).
    app.add_config_value("search_key_terms", KEY_TERMS, "html", types=[dict])
    app.connect("config-inited", _use_the_scorer)
    app.connect("doctree-resolved", _add_key_terms)
    app.connect("env-updated", _check_key_terms)
    app.connect("html-page-context", _search_page_script)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
