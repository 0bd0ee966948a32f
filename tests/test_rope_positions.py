"""`apply_rope` with one row of positions per batch row: (B, L) positions for (B, h, L, d) x.

Positions are read batch first, like every shape in the book: row b of every head turns by
``positions[b]``. Broadcasting them from the right instead would pair B with the heads, which
goes unnoticed exactly when B == h, so that case is tested here.
"""

from __future__ import annotations

import pytest
import torch

from utils.positional import apply_rope


def _row_by_row(x: torch.Tensor, positions: torch.Tensor, layout: str) -> torch.Tensor:
    """The reference: each batch row b rotated alone, by its own (L,) positions."""
    return torch.stack([apply_rope(x[b], positions[b], layout=layout) for b in range(len(x))])


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("batch, heads", [(3, 3), (2, 4), (4, 1)])
def test_batch_positions_rotate_each_row_of_every_head(batch, heads, layout):
    g = torch.Generator().manual_seed(batch * 10 + heads)
    x = torch.randn(batch, heads, 5, 8, dtype=torch.float64, generator=g)
    positions = torch.randint(0, 50, (batch, 5), generator=g)
    got = apply_rope(x, positions, layout=layout)
    torch.testing.assert_close(got, _row_by_row(x, positions, layout), atol=1e-12, rtol=0)
    # the explicit (B, 1, L) form means the same
    torch.testing.assert_close(got, apply_rope(x, positions[:, None], layout=layout))


def test_square_case_is_not_read_per_head():
    """B == h: reading (B, L) per head would rotate head j of every row by positions[j]."""
    x = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2], [10, 11, 12]])
    got = apply_rope(x, positions)
    per_head = apply_rope(x, positions[None])  # (1, h, L): explicitly per head
    torch.testing.assert_close(got[0, 1], apply_rope(x[0, 1], positions[0]))
    assert not torch.allclose(got, per_head)
    # row 0 sits at 0, 1, 2 in both heads: its first vectors are not turned at all
    torch.testing.assert_close(got[0, :, 0], x[0, :, 0])


def test_one_token_per_row_as_in_cached_decoding():
    """A step of cached decoding: one new query per row, at a different position per row."""
    x = torch.randn(4, 4, 1, 6, dtype=torch.float64)
    positions = torch.tensor([[3], [7], [0], [5]])  # (B, 1)
    got = apply_rope(x, positions, layout="half")
    for b in range(4):
        torch.testing.assert_close(got[b], apply_rope(x[b], positions[b], layout="half"))


def test_earlier_calls_keep_their_meaning():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    shared = torch.arange(5) + 4
    # (L,) is shared by every row and head
    torch.testing.assert_close(
        apply_rope(x, shared), _row_by_row(x, shared.expand(2, 5), "interleaved")
    )
    # full-rank positions broadcast as before
    full = torch.randint(0, 9, (2, 3, 5))
    for b in range(2):
        for j in range(3):
            torch.testing.assert_close(apply_rope(x, full)[b, j], apply_rope(x[b, j], full[b, j]))
    # (B, L) for 3-dim x (B, L, d)
    y = torch.randn(2, 5, 8, dtype=torch.float64)
    rows = torch.randint(0, 9, (2, 5))
    torch.testing.assert_close(apply_rope(y, rows), _row_by_row(y, rows, "interleaved"))


@pytest.mark.parametrize(
    "x_shape, pos_shape",
    [
        ((2, 4, 5, 8), (4, 5)),  # h rows of positions: used to pass as per-head, now refused
        ((2, 4, 5, 8), (3, 5)),
        ((2, 5, 8), (3, 5)),
        ((5, 8), (2, 5)),  # more batch dims than x has
        ((2, 4, 5, 8), (2, 3, 5)),
    ],
)
def test_positions_that_do_not_fit_name_both_shapes(x_shape, pos_shape):
    x = torch.randn(*x_shape)
    positions = torch.zeros(pos_shape, dtype=torch.long)
    pos_str = "(" + ", ".join(map(str, pos_shape)) + ")"
    x_str = "(" + ", ".join(map(str, x_shape)) + ")"
    with pytest.raises(ValueError) as info:
        apply_rope(x, positions)
    message = str(info.value)
    assert f"positions of shape {pos_str}" in message
    assert f"x is {x_str}" in message
