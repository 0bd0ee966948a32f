"""utils.glue writes the output that myst-nb's glue writes, and refuses what it cannot paste."""

from __future__ import annotations

import numpy as np
import pytest
from myst_nb.core.variables import format_plain_text

from utils.glue import GLUE_PREFIX, glue, glue_bundle


@pytest.mark.parametrize(
    ("value", "fmt", "pasted"),
    [
        (0.906, ".1%", "90.6%"),
        (1297, ",d", "1,297"),
        ("2,048", "s", "2,048"),
        (np.float64(0.25), ".2f", "0.25"),
        (np.int64(7), "d", "7"),
        (True, "s", "True"),
    ],
)
def test_pasted_as_myst_nb_formats_it(value, fmt, pasted):
    data, metadata = glue_bundle("some-key", value)
    assert list(data) == [GLUE_PREFIX + "text/plain"]
    assert metadata == {"scrapbook": {"name": "some-key", "mime_prefix": GLUE_PREFIX}}
    assert format_plain_text(data[GLUE_PREFIX + "text/plain"], fmt) == pasted


def test_same_output_as_myst_nb(monkeypatch):
    import IPython.display
    from myst_nb import glue as myst_glue

    shown = []
    monkeypatch.setattr(
        IPython.display, "display", lambda *a, **k: shown.append((a, k)), raising=True
    )
    import myst_nb.ext.glue as ext

    monkeypatch.setattr(ext, "ipy_display", lambda *a, **k: shown.append((a, k)))
    myst_glue("acc", 0.5, display=False)
    glue("acc", 0.5)
    assert shown[0] == shown[1]


@pytest.mark.parametrize("name", ["", "a b", "key:fmt", "-x", 3])
def test_bad_keys(name):
    with pytest.raises(ValueError, match="glue key"):
        glue_bundle(name, 1)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite(value):
    with pytest.raises(ValueError, match="finite"):
        glue_bundle("k", value)


def test_other_types_refused():
    import torch

    with pytest.raises(ValueError, match=r"got Tensor.*\.item\(\)"):
        glue_bundle("k", torch.tensor(1.0))
    with pytest.raises(ValueError, match="display=True"):
        glue("k", 1, display=True)
