"""Pasting a measured number into the book's prose: a light stand-in for myst-nb's ``glue``.

A chapter's cell calls ``glue("key", value)``; the Markdown beside it writes
{glue:text}`key` (or {glue:text}`key:.1%` to format it), and the book pastes the value that the
cell stored in its outputs. The output written here is exactly the one that
``myst_nb.glue(name, value, display=False)`` writes (a display output whose MIME type carries
the ``application/papermill.record/`` prefix, and ``scrapbook`` metadata naming the key), so
myst-nb reads it when it builds the book and nbval compares it with the rest of the outputs.

Why not ``myst_nb.glue`` itself: its first call imports nbformat's schema validation (jsonschema
and its format checkers), several seconds on a laptop, in every chapter; this module imports
nothing beyond IPython, which a notebook's kernel has already loaded.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

__all__ = ["GLUE_PREFIX", "glue", "glue_bundle"]

GLUE_PREFIX = "application/papermill.record/"
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def glue_bundle(name: str, value: Any) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The (data, metadata) of the hidden display output that glues ``value`` under ``name``.

    ``value`` is a number (an int or a finite float, NumPy's included), a bool or a string;
    its ``repr`` is what the book pastes (a string's quotes are removed when it is pasted).
    Raises ``ValueError`` for a key that myst-nb's roles cannot name (empty, or with ``:`` or
    spaces), for a non-finite float, and for any other type.
    """
    if not isinstance(name, str) or not _KEY.fullmatch(name):
        raise ValueError(
            f"glue key must be letters, digits, '-', '_' or '.', starting with a letter or "
            f"digit; got {name!r}"
        )
    if isinstance(value, (bool, str)):
        text = repr(value)
    elif isinstance(value, numbers.Integral):  # int, or NumPy's integers
        text = repr(int(value))
    elif isinstance(value, numbers.Real):  # float, or NumPy's floats (whose repr names them)
        if not math.isfinite(value):
            raise ValueError(f"glue {name!r}: expected a finite number, got {value!r}")
        text = repr(float(value))
    else:
        raise ValueError(
            f"glue {name!r}: expected an int, float, bool or str, got {type(value).__name__} "
            "(convert a tensor with .item() and round it as the cell prints it)"
        )
    data = {GLUE_PREFIX + "text/plain": text}
    metadata = {"scrapbook": {"name": name, "mime_prefix": GLUE_PREFIX}}
    return data, metadata


def glue(name: str, value: Any, display: bool = False) -> None:
    """Store ``value`` under ``name`` in the cell's outputs, hidden, for the prose to paste.

    Same output as ``myst_nb.glue(name, value, display=False)``. ``display=True`` is refused:
    the cell shows what it prints, and the glued copy stays out of sight.
    """
    if display:
        raise ValueError("glue(..., display=True) is not supported: print the value instead")
    from IPython.display import display as ipython_display

    data, metadata = glue_bundle(name, value)
    ipython_display(data, raw=True, metadata=metadata)
