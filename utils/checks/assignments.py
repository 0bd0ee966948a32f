"""Every assignment of the book, by the name of its notebook, in the book's order."""

from __future__ import annotations

from . import (
    a1_attention,
    a2_multi_head_attention,
    a3_masks,
    a4_positional_layer_norm,
    a5_feed_forward,
    a6_encoder_layer,
    a7_decoder_layer,
    a8_train,
    a9_adapting,
)
from .guard import Assignment

ASSIGNMENTS: dict[str, Assignment] = {
    a.name: a for a in (a1_attention.ASSIGNMENT, a2_multi_head_attention.ASSIGNMENT,
                        a3_masks.ASSIGNMENT, a4_positional_layer_norm.ASSIGNMENT,
                        a5_feed_forward.ASSIGNMENT, a6_encoder_layer.ASSIGNMENT,
                        a7_decoder_layer.ASSIGNMENT, a8_train.ASSIGNMENT,
                        a9_adapting.ASSIGNMENT)
}
