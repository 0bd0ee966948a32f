"""Checkers for the programming assignments: run a student's code and say what is wrong.

One module per assignment, in the book's order (`a1_attention`, `a2_multi_head_attention`,
`a3_masks`, `a4_positional_layer_norm`, `a5_feed_forward`, `a6_encoder_layer`,
`a7_decoder_layer`, `a8_train`), on a small shared core:

* `core`: cases, the student side (`exercise`) and the trusted side (`Checker.judge`), results;
* `guard`: what each assignment forbids and how the grader notices it;
* `sandbox` (with `child` and `protocol`): a submission run in its own process, for grading.

In a notebook, each ``check_*`` function runs its cases at once, prints one line per case and
returns a `CheckResult` with ``.passed``, ``.score`` (the fraction of the points earned) and
``.cases``. A checker never raises because of the student's code.
"""

from __future__ import annotations

from .a1_attention import check_scaled_dot_product_attention
from .a2_multi_head_attention import check_multi_head_attention
from .a3_masks import (
    check_batch_mask,
    check_batch_mask_test,
    check_causal_mask,
    check_causal_mask_test,
    check_padding_mask,
)
from .a4_positional_layer_norm import check_layer_norm, check_positional_encoding
from .a5_feed_forward import check_swiglu_feed_forward, check_top_k_moe
from .a6_encoder_layer import check_encoder_layer
from .a7_decoder_layer import check_decoder_layer
from .a8_train import check_training
from .assignments import ASSIGNMENTS
from .core import CaseResult, CheckResult

__all__ = [
    "ASSIGNMENTS",
    "CaseResult",
    "CheckResult",
    "check_scaled_dot_product_attention",
    "check_multi_head_attention",
    "check_causal_mask",
    "check_padding_mask",
    "check_batch_mask",
    "check_causal_mask_test",
    "check_batch_mask_test",
    "check_positional_encoding",
    "check_layer_norm",
    "check_swiglu_feed_forward",
    "check_top_k_moe",
    "check_encoder_layer",
    "check_decoder_layer",
    "check_training",
]
