"""Checkers for the programming assignments: run a student's code and say what is wrong.

One module per assignment (`a1_attention`, `a2_multi_head_attention`,
`a4_positional_layer_norm`, `a6_encoder_layer`) on a small shared core:

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
from .a4_positional_layer_norm import check_layer_norm, check_positional_encoding
from .a6_encoder_layer import check_encoder_layer
from .a8_train import check_training
from .assignments import ASSIGNMENTS
from .core import CaseResult, CheckResult

__all__ = [
    "ASSIGNMENTS",
    "CaseResult",
    "CheckResult",
    "check_scaled_dot_product_attention",
    "check_multi_head_attention",
    "check_positional_encoding",
    "check_layer_norm",
    "check_encoder_layer",
    "check_training",
]
