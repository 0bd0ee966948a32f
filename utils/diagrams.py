"""The architecture figure: an encoder-decoder Transformer drawn as the classic diagram of
Vaswani et al. (2017), read from its own modules (chapters 1 and 9).

`architecture_figure(model)` takes a `utils.transformer.Transformer` (or a model that holds one as
``.transformer``, such as `utils.models.Seq2SeqTransformer`) and returns a matplotlib figure: the
embeddings, each stack's layer with its sublayers in the order its ``forward`` calls them, N× beside
it, and the output head. It imports the layer and stack classes only inside its functions, to
recognise them; no module of the library imports this one (notebooks do)."""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch
from torch import nn

from ._validation import require_real
from .plotting import _check_text

__all__ = ["architecture_figure"]


# Colours of the boxes by what they hold, after the figure of Vaswani et al. (2017).
_FILL = {"attention": "#fce3c0", "ff": "#cde8f6", "norm": "#f3f0b8", "embedding": "#f7d3dc",
         "positions": "#ffffff", "output": "#ddd6ee", "outside": "#ffffff"}
_FONT = 8.0  # points: the smallest text of the figure
_LINE = _FONT * 1.25 / 72  # inches per line of text
_GAP = 0.15  # inches between two boxes of a column (the arrow between them)


@dataclass
class _Box:
    """One box of a column: its lines of text, its kind (the fill), dashed when the step is not
    a module of the model drawn. ``add`` marks the residual addition (a circle)."""

    lines: list[str]
    kind: str
    dashed: bool = False
    add: bool = False
    reads_memory: bool = False  # cross-attention: the encoder's output comes in from the side
    residual_from: int | None = None  # the index of the box whose input the addition adds
    y: float = 0.0  # bottom, set when the column is laid out
    height: float = 0.0

    @property
    def top(self) -> float:
        return self.y + self.height


def _traced_sublayers(layer: nn.Module, memory: bool) -> list[tuple[str, nn.Module, bool]]:
    """Run ``layer`` once on zeros and record, in the order its forward calls them, its children
    that are not dropouts: ``(name, module, reads_memory)``. ``reads_memory`` is True for an
    attention whose keys are the memory (cross-attention).

    The run changes nothing: the layer is in eval mode for it (no dropout, no random numbers
    drawn), gradients are off, and the weights an attention keeps (``attn_weights``) are put
    back afterwards.
    """
    p = next(layer.parameters(), None)
    dtype, device = (p.dtype, p.device) if p is not None else (torch.float32, None)
    d_model = int(layer.d_model)
    x = torch.zeros(1, 2, d_model, dtype=dtype, device=device)
    mem = torch.zeros(1, 3, d_model, dtype=dtype, device=device)
    calls: list[tuple[str, nn.Module, bool]] = []
    handles = []
    for name, child in layer.named_children():
        if isinstance(child, nn.Dropout):
            continue

        def hook(module, args, output, name=name):
            reads = memory and len(args) > 1 and args[1] is mem
            calls.append((name, module, reads))

        handles.append(child.register_forward_hook(hook))
    modes = {m: m.training for m in layer.modules()}
    kept = {m: m.attn_weights for m in layer.modules() if hasattr(m, "attn_weights")}
    try:
        layer.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            if memory:
                layer(x, mem)
            else:
                layer(x)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
        for m, w in kept.items():
            m.attn_weights = w
    return calls


def _layer_boxes(layer: nn.Module, decoder: bool) -> list[_Box]:
    """The boxes of one encoder or decoder layer, bottom to top, in the order its forward
    applies its sublayers: post-LN (sublayer, then add & norm) or pre-LN (norm, sublayer, add),
    read from the order of the calls."""
    from .attention import GroupedQueryAttention, MultiHeadAttention
    from .layers import LayerNorm, PositionwiseFeedForward, RMSNorm

    norms = (LayerNorm, RMSNorm, nn.LayerNorm, nn.RMSNorm)
    calls = _traced_sublayers(layer, decoder)
    kinds = ["norm" if isinstance(m, norms) else "sub" for _, m, _ in calls]
    pre = len(kinds) > 0 and kinds[0] == "norm"
    pattern = ["norm", "sub"] if pre else ["sub", "norm"]
    if len(kinds) % 2 or any(k != pattern[i % 2] for i, k in enumerate(kinds)):
        order = ", ".join(name for name, _, _ in calls)
        raise ValueError(f"expected each sublayer of a {type(layer).__name__} to come with one "
                         f"norm, before it (pre-LN) or after it (post-LN); its forward calls "
                         f"{order}")

    def sub_box(module: nn.Module, reads_memory: bool) -> _Box:
        if isinstance(module, (MultiHeadAttention, GroupedQueryAttention)):
            heads = f"h = {module.num_heads}"
            if getattr(module, "num_kv_heads", module.num_heads) != module.num_heads:
                heads += f", {module.num_kv_heads} key/value heads"
            if reads_memory:
                return _Box(["Multi-head cross-attention",
                             f"{heads}; keys, values: encoder"], "attention", reads_memory=True)
            what = "Masked multi-head self-attention" if decoder else "Multi-head self-attention"
            return _Box([what, f"{heads}, d_k = {module.d_k}"], "attention")
        if isinstance(module, PositionwiseFeedForward):
            return _Box([f"Feed-forward, {module.activation}",
                         f"{module.d_model} → {module.d_ff} → {module.d_model}"], "ff")
        raise ValueError(f"expected the sublayers of a {type(layer).__name__} to be attention "
                         f"or a PositionwiseFeedForward, got {type(module).__name__}")

    boxes: list[_Box] = []
    for i in range(0, len(calls), 2):
        if pre:
            (_, norm, _), (_, sub, reads) = calls[i], calls[i + 1]
            first = len(boxes)
            boxes.append(_Box([type(norm).__name__], "norm"))
            boxes.append(sub_box(sub, reads))
            boxes.append(_Box(["+"], "norm", add=True, residual_from=first))
        else:
            (_, sub, reads), (_, norm, _) = calls[i], calls[i + 1]
            first = len(boxes)
            boxes.append(sub_box(sub, reads))
            boxes.append(_Box([f"Add & {type(norm).__name__}"], "norm", residual_from=first))
    return boxes


def _stack_layers(stack: nn.Module, name: str, decoder: bool) -> tuple[int, list[_Box]]:
    """N and the boxes of the stack's layer; every layer must draw the same."""
    layers = list(getattr(stack, "layers", []))
    if not layers:
        raise ValueError(f"expected the {name} to have layers, got none")
    drawn = [_layer_boxes(layer, decoder) for layer in layers]
    for i, boxes in enumerate(drawn[1:], start=1):
        if [b.lines for b in boxes] != [b.lines for b in drawn[0]]:
            raise ValueError(f"expected every layer of the {name} to be alike (the figure draws "
                             f"one layer N times), but layer {i} differs from layer 0")
    return len(layers), drawn[0]


def _embedding_boxes(embed: nn.Module | None, side: str, d_model: int,
                     shared: bool) -> list[_Box]:
    """Token embedding and positions of one side, or a dashed box for a bare Transformer."""
    from .positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding

    if embed is None:
        return [_Box([f"{side} vectors, width {d_model}", "embedding + positions"], "outside",
                     dashed=True)]
    tokens = embed.tokens
    scaled = " × √d_model" if tokens.scale != 1.0 else ""
    boxes = [_Box([f"Token embedding{scaled}",
                   "shared with the source" if shared
                   else f"V = {tokens.vocab_size}, d_model = {tokens.d_model}"], "embedding")]
    positions = embed.positions
    if isinstance(positions, SinusoidalPositionalEncoding):
        boxes.append(_Box(["+ sinusoidal positional encoding"], "positions"))
    elif isinstance(positions, LearnedPositionalEmbedding):
        boxes.append(_Box(["+ learned positional embedding"], "positions"))
    elif positions is not None:
        boxes.append(_Box([f"+ {type(positions).__name__}"], "positions"))
    return boxes


def _output_boxes(head: nn.Module | None, d_model: int) -> list[_Box]:
    if head is None:
        return [_Box([f"output vectors, width {d_model}", "linear + softmax"], "outside",
                     dashed=True)]
    if getattr(head, "tied", False):
        table = head.embedding[0].weight
        box = _Box([f"Linear {table.shape[1]} → {table.shape[0]}",
                    "tied: the embedding, transposed"], "output")
    else:
        proj = head.proj
        box = _Box([f"Linear {proj.in_features} → {proj.out_features}"], "output")
    return [box, _Box(["Softmax (in the loss and in decoding)"], "outside", dashed=True)]


def _parts(model: object) -> tuple[nn.Module, nn.Module | None, nn.Module | None,
                                   nn.Module | None]:
    """(transformer, source embedding, target embedding, output head) of ``model``, or a
    ValueError saying what the figure expects."""
    from .transformer import Decoder, Encoder, Transformer

    expected = ("a utils.transformer.Transformer, or a model that holds one as .transformer "
                "(utils.models.Seq2SeqTransformer)")
    if isinstance(model, nn.Transformer):
        raise ValueError(f"architecture_figure expects {expected}, got torch's nn.Transformer; "
                         "copy it first with utils.transformer.Transformer.from_torch")
    if isinstance(model, Transformer):
        core, src, tgt, head = model, None, None, None
    elif isinstance(getattr(model, "transformer", None), Transformer):
        core = model.transformer
        src, tgt = getattr(model, "src_embed", None), getattr(model, "tgt_embed", None)
        head = getattr(model, "head", None)
    else:
        missing = ""
        if isinstance(model, nn.Module) and not any(
                isinstance(m, Decoder) for m in model.modules()):
            missing = ", which has no decoder"
        raise ValueError(f"architecture_figure draws an encoder-decoder Transformer: it "
                         f"expects {expected}, got {type(model).__name__}{missing}")
    for part, cls in (("encoder", Encoder), ("decoder", Decoder)):
        if not isinstance(getattr(core, part, None), cls):
            raise ValueError(f"architecture_figure expects the Transformer's {part} to be a "
                             f"utils.transformer.{cls.__name__}, got "
                             f"{type(getattr(core, part, None)).__name__}")
    return core, src, tgt, head


def architecture_figure(model: nn.Module, title: str | None = None,
                        width: float = 6.6) -> Figure:
    """Draw an encoder-decoder Transformer as the classic diagram, read from its own modules.

    Encoder on the left, decoder on the right, inputs at the bottom: the source and target
    token embeddings and positional encodings; the encoder layer with its sublayers in the
    order its ``forward`` applies them (found by running the layer once on zeros and recording
    the calls): self-attention with its number of heads, feed-forward d_model → d_ff → d_model
    with its activation, each with its residual connection and norm, drawn as "Add & Norm"
    after the sublayer (post-LN) or as a norm before it and an addition after it (pre-LN); the
    same for the decoder layer, with masked self-attention and cross-attention, whose keys and
    values come from the encoder's output (an arrow from the encoder); N× beside each stack;
    the final norms if the stacks have them; the output projection and the softmax. Every
    count and name is read from the modules, so the figure cannot drift from the code. Dashed
    boxes are steps that no module of ``model`` computes (a bare `Transformer` has no
    embeddings and no output projection; the softmax lives in the loss and in decoding).

    Drawing runs each layer once on zeros, in eval mode and without gradients; it draws no
    random numbers and leaves the model as it was (train/eval mode, kept attention weights).
    A model on PyTorch's meta device (shapes, no numbers) can be drawn too.

    Args:
        model: a `utils.transformer.Transformer`, or a model holding one as ``.transformer``
            with ``src_embed``, ``tgt_embed`` and ``head`` (`utils.models.Seq2SeqTransformer`).
        title: the figure's title; by default the model's class, depths and d_model.
        width: the figure's width in inches, 5.5 to 6.7 (the book's column is 6.7 inches at
            100 dpi); the height follows from the number of boxes.

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: for a model this cannot draw, naming what it expected: torch's own
            ``nn.Transformer`` (copy it with ``Transformer.from_torch``), a model without a
            decoder (`utils.models.DecoderOnlyLM`, an `Encoder`), layers that differ from one
            another, or a layer whose sublayers do not each come with one norm.
        InputTypeError: for a title that is not a string or a width that is not a number.
    """
    core, src_embed, tgt_embed, head = _parts(model)
    if title is not None:
        _check_text("title", title)
    width = require_real("width", width)
    if not 5.5 <= width <= 6.7:
        raise ValueError(f"width must be between 5.5 and 6.7 inches, got {width}")
    d_model = int(core.d_model)
    n_enc, enc_boxes = _stack_layers(core.encoder, "encoder", decoder=False)
    n_dec, dec_boxes = _stack_layers(core.decoder, "decoder", decoder=True)
    pre = any(b.add for b in enc_boxes)
    shared = src_embed is not None and src_embed is tgt_embed
    if title is None:
        title = (f"{type(model).__name__}: {n_enc} + {n_dec} layers, d_model = {d_model}, "
                 f"{'pre' if pre else 'post'}-LN")

    def final(stack: nn.Module) -> list[_Box]:
        norm = getattr(stack, "norm", None)
        return [] if norm is None else [_Box([f"{type(norm).__name__} (final)"], "norm")]

    enc_in = _embedding_boxes(src_embed, "source", d_model, False)
    dec_in = _embedding_boxes(tgt_embed, "target", d_model, shared)
    enc_top, dec_top = final(core.encoder), final(core.decoder) + _output_boxes(head, d_model)

    # Columns, in inches: the encoder's residual lines run on its left, the decoder's on its
    # right, and the memory's arrow between the two stacks.
    box_w = (width - 2.0) / 2
    enc_x = 0.8
    dec_x = width - 0.8 - box_w
    lane = (enc_x + box_w + dec_x) / 2

    def height(b: _Box) -> float:
        return 0.2 if b.add else _LINE * len(b.lines) + 0.14

    def stack_up(boxes: list[_Box], y: float) -> float:
        for b in boxes:
            b.height = height(b)
            b.y = y
            y = b.top + _GAP
        return y - _GAP

    pad = 0.12  # inside the frame of a stack
    bottom = 0.75  # room for the input captions and the key to the dashed boxes
    columns = {}
    for side, inputs, layer, outputs in (("enc", enc_in, enc_boxes, enc_top),
                                         ("dec", dec_in, dec_boxes, dec_top)):
        y = stack_up(inputs, bottom)
        frame_bottom = y + _GAP
        y = stack_up(layer, frame_bottom + pad)
        frame_top = y + pad
        y = stack_up(outputs, frame_top + _GAP) if outputs else frame_top
        columns[side] = (inputs, layer, outputs, frame_bottom, frame_top, y)
    top = max(c[5] for c in columns.values())
    total_h = top + 0.45 + 0.3  # the output caption and the title

    fig = plt.figure(figsize=(width, total_h))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, total_h)
    ax.axis("off")
    text_kw = dict(ha="center", va="center", fontsize=_FONT, color="black")
    arrow_kw = dict(arrowstyle="-|>", mutation_scale=8, color="0.25", lw=0.9,
                    shrinkA=0, shrinkB=0)

    def arrow(points: list[tuple[float, float]]) -> None:
        for a, b in zip(points[:-2], points[1:-1], strict=True):
            ax.plot([a[0], b[0]], [a[1], b[1]], color="0.25", lw=0.9, solid_capstyle="butt")
        ax.add_patch(FancyArrowPatch(points[-2], points[-1], **arrow_kw))

    def draw_box(b: _Box, x: float) -> None:
        cx = x + box_w / 2
        if b.add:
            ax.add_patch(Circle((cx, b.y + 0.1), 0.1, facecolor=_FILL["norm"],
                                edgecolor="0.2", lw=0.9))
            ax.text(cx, b.y + 0.1, "+", **{**text_kw, "fontsize": 9})
            return
        ax.add_patch(FancyBboxPatch((x, b.y), box_w, b.height,
                                    boxstyle="round,pad=0,rounding_size=0.05",
                                    facecolor=_FILL[b.kind], edgecolor="0.2", lw=0.9,
                                    linestyle="--" if b.dashed else "-"))
        ax.text(cx, b.y + b.height / 2, "\n".join(b.lines), linespacing=1.25, **text_kw)

    for side, x in (("enc", enc_x), ("dec", dec_x)):
        inputs, layer, outputs, f_bottom, f_top, _ = columns[side]
        cx = x + box_w / 2
        everything = inputs + layer + outputs
        for b in everything:
            draw_box(b, x)
        # The main flow: an arrow into the first box, then from each box to the next.
        arrow([(cx, bottom - 0.22), (cx, everything[0].y)])
        for a, b in zip(everything, everything[1:], strict=False):
            arrow([(cx, a.top), (cx, b.y)])
        if side == "dec":
            arrow([(cx, everything[-1].top), (cx, everything[-1].top + 0.22)])
        # The stack: a frame around the layer and N× beside it.
        fx = x - 0.3 if side == "enc" else x - 0.1
        ax.add_patch(FancyBboxPatch((fx, f_bottom), box_w + 0.4, f_top - f_bottom,
                                    boxstyle="round,pad=0,rounding_size=0.1",
                                    facecolor="#f4f4f4", edgecolor="0.45", lw=0.9, zorder=0))
        n = n_enc if side == "enc" else n_dec
        nx = fx - 0.2 if side == "enc" else fx + box_w + 0.4 + 0.2
        ax.text(nx, (f_bottom + f_top) / 2, f"{n}×", **{**text_kw, "fontsize": 10})
        # Residual connections: from just below the sublayer's input to the addition.
        rx = x - 0.15 if side == "enc" else x + box_w + 0.15
        for b in layer:
            if b.residual_from is None:
                continue
            start = layer[b.residual_from].y - _GAP / 2
            end_x = x if side == "enc" else x + box_w
            if b.add:
                end_x = cx - 0.1 if side == "enc" else cx + 0.1
            y_end = b.y + b.height / 2
            ax.plot([cx, rx, rx], [start, start, y_end], color="0.25", lw=0.9)
            ax.add_patch(FancyArrowPatch((rx, y_end), (end_x, y_end), **arrow_kw))
    # The memory: from the encoder's output to every cross-attention of the decoder.
    enc_cx = enc_x + box_w / 2
    enc_out = columns["enc"][2][-1].top if columns["enc"][2] else columns["enc"][4]
    for b in dec_boxes:
        if b.reads_memory:
            y = b.y + b.height / 2
            up = enc_out + 0.2
            ax.plot([enc_cx, enc_cx, lane, lane], [enc_out, up, up, y], color="0.25", lw=0.9)
            ax.add_patch(FancyArrowPatch((lane, y), (dec_x, y), **arrow_kw))
            ax.text(enc_cx - 0.06, up, "encoder output (memory)", **{**text_kw, "ha": "right"})
    ax.text(enc_x + box_w / 2, bottom - 0.32, "source tokens" if src_embed else "source",
            **text_kw)
    ax.text(dec_x + box_w / 2, bottom - 0.32,
            "target tokens, shifted right" if tgt_embed else "target, shifted right", **text_kw)
    ax.text(dec_x + box_w / 2, top + 0.32,
            "next-token probabilities" if head is not None else "output", **text_kw)
    ax.text(width / 2, total_h - 0.2, title, **{**text_kw, "fontsize": 10})
    ax.text(width / 2, 0.14, f"dashed: a step that no module of {type(model).__name__} computes",
            **{**text_kw, "color": "0.3"})
    return fig
