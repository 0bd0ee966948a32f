"""Checkers for the programming assignments: run a student's code and say what is wrong.

One module per assignment, in the book's order (`a1_attention`, `a2_multi_head_attention`,
`a3_masks` with `a3_mask_tests`, `a4_positional_layer_norm`, `a5_feed_forward`,
`a6_encoder_layer`, `a7_decoder_layer`, `a8_train` with `a8_judges`, `a9_adapting` with
`a9_lora` and `a9_loss`), on a small shared core:

* `core`: the student side (`Spec`, `exercise`);
* `checker` (with `compare`): the trusted side, a reference, its mistakes and its cases
  (`Checker.judge`, `Case`), and `run_in_process`, which runs both sides in a notebook;
* `results`: what a check returns and prints (`CheckResult`);
* `guard`: what each assignment forbids (`Rule`, `Assignment`);
* `runners` (with `training_runner`, `training_task`): how a case exercises the student's code,
  the same in a notebook and in the grader's child; `sublayers`: what assignments 6 and 7 share;
* `assignments`: every assignment, in order (`ASSIGNMENTS`).

This package holds only what a notebook imports to check an exercise. The grader (the sandbox,
its child and zygote, the kernel's confinement, the protocol, the reading of submissions) is the
top-level package `grader`, which uses this one; nothing under ``utils`` imports it.

The names below are imported on first use (PEP 562), so that the grader's sandboxed child can
import the student side (`core`, `results`, `runners`) without the checkers' references: the
child never holds the code that computes an expected value.

In a notebook, each ``check_*`` function runs its cases at once, prints one line per case and
returns a `CheckResult` with ``.passed``, ``.score`` (the fraction of the points earned) and
``.cases``. A checker never raises because of the student's code.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "check_scaled_dot_product_attention": "a1_attention",
    "check_multi_head_attention": "a2_multi_head_attention",
    "check_causal_mask": "a3_masks",
    "check_padding_mask": "a3_masks",
    "check_batch_mask": "a3_masks",
    "check_causal_mask_test": "a3_mask_tests",
    "check_batch_mask_test": "a3_mask_tests",
    "check_positional_encoding": "a4_positional_layer_norm",
    "check_layer_norm": "a4_positional_layer_norm",
    "check_swiglu_feed_forward": "a5_feed_forward",
    "check_top_k_moe": "a5_feed_forward",
    "check_encoder_layer": "a6_encoder_layer",
    "check_decoder_layer": "a7_decoder_layer",
    "check_training": "a8_train",
    "check_top_p_filter": "a9_adapting",
    "check_lora_linear": "a9_lora",
    "check_answer_only_loss": "a9_loss",
    "ASSIGNMENTS": "assignments",
    "CaseResult": "results",
    "CheckResult": "results",
}

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
    "check_top_p_filter",
    "check_lora_linear",
    "check_answer_only_loss",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'utils.checks' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
