"""utils.graph (chapter 11): adjacency masks, and a graph attention layer that mixes neighbours."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from utils.attention import MultiHeadAttention
from utils.graph import GraphAttentionLayer, adjacency_mask
from utils.masks import to_torch_attn_mask

# A path 0 - 1 - 2 - 3 and an isolated node 4.
EDGES = torch.tensor([[0, 1, 2], [1, 2, 3]])


def test_adjacency_mask_from_edge_list():
    m = adjacency_mask(EDGES, num_nodes=5)
    expected = torch.tensor([[1, 1, 0, 0, 0],
                             [1, 1, 1, 0, 0],
                             [0, 1, 1, 1, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)
    no_loops = adjacency_mask(EDGES, num_nodes=5, self_loops=False)
    assert torch.equal(no_loops, expected & ~torch.eye(5, dtype=torch.bool))
    directed = adjacency_mask(EDGES, num_nodes=5, self_loops=False, undirected=False)
    assert directed.sum() == 3 and bool(directed[0, 1]) and not bool(directed[1, 0])


def test_adjacency_mask_from_matrix_agrees_with_edge_list():
    a = torch.zeros(5, 5)
    a[0, 1] = a[1, 2] = a[2, 3] = 2.5                  # weighted, one direction only
    assert torch.equal(adjacency_mask(a), adjacency_mask(EDGES, num_nodes=5))
    assert torch.equal(adjacency_mask(a.bool(), undirected=False, self_loops=False), a != 0)


def test_layer_mixes_neighbours_only():
    torch.manual_seed(0)
    layer = GraphAttentionLayer(8, num_heads=2, residual=False, activation="none")
    mask = adjacency_mask(EDGES, num_nodes=5)
    x = torch.randn(5, 8, requires_grad=True)
    out = layer(x, mask)
    for i in range(5):
        (grad,) = torch.autograd.grad(out[i].sum(), x, retain_graph=True)
        touched = grad.abs().sum(-1) > 0
        assert torch.equal(touched, mask[i]), f"node {i} depends on {touched.nonzero().tolist()}"
    weights = layer.attn.attn_weights[0]               # (h, N, N)
    assert bool((weights[:, ~mask] == 0).all())
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 5))


def test_isolated_node_without_self_loop_gets_zero_attention_not_nan():
    layer = GraphAttentionLayer(4, residual=False, activation="none")
    nn.init.zeros_(layer.attn.w_o.bias)
    mask = adjacency_mask(EDGES, num_nodes=5, self_loops=False)
    out = layer(torch.randn(5, 4), mask)
    assert torch.isfinite(out).all() and torch.equal(out[4], torch.zeros(4))


def test_layer_batched_residual_and_activation():
    torch.manual_seed(0)
    layer = GraphAttentionLayer(8, num_heads=2)
    x = torch.randn(5, 5, 8)                           # B == N: the mask must not be ambiguous
    mask = adjacency_mask(EDGES, num_nodes=5)
    out = layer(x, mask)
    assert out.shape == (5, 5, 8)
    expected = nn.functional.elu(x + layer.attn(x, x, x, mask[None]))
    torch.testing.assert_close(out, expected)
    per_graph = layer(x, mask.expand(5, 5, 5))
    torch.testing.assert_close(out, per_graph)


def test_layer_equals_torch_multihead_attention_with_the_mask():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    layer = GraphAttentionLayer(8, num_heads=2, residual=False, activation="none")
    layer.attn = MultiHeadAttention.from_torch(mha)
    mask = adjacency_mask(EDGES, num_nodes=5)
    x = torch.randn(1, 5, 8)
    theirs, _ = mha(x, x, x, attn_mask=to_torch_attn_mask(mask))
    torch.testing.assert_close(layer(x, mask), theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: adjacency_mask(torch.zeros(3, 4)), ValueError, r"square \(N, N\), got \(3, 4\)"),
        (lambda: adjacency_mask(torch.zeros(3, 2, dtype=torch.long), num_nodes=3), ValueError,
         r"\(2, E\).*\(3, 2\)"),
        (lambda: adjacency_mask(torch.tensor([[0, 5], [1, 2]]), num_nodes=3), ValueError,
         r"\[0, num_nodes=3\).*0 to 5"),
        (lambda: adjacency_mask(torch.zeros(2, 3), num_nodes=3), TypeError, "integer node ids"),
        (lambda: adjacency_mask([[0, 1]]), TypeError, "torch.Tensor"),
        (lambda: adjacency_mask(torch.zeros(3, 3), self_loops=1), TypeError, "self_loops"),
        (lambda: GraphAttentionLayer(8, activation="tanh"), ValueError, "activation"),
        (lambda: GraphAttentionLayer(8, 3), ValueError, "divisible"),
        (lambda: GraphAttentionLayer(8)(torch.randn(5, 7), torch.ones(5, 5, dtype=torch.bool)),
         ValueError, r"\(N, d_model=8\).*\(5, 7\)"),
        (lambda: GraphAttentionLayer(8)(torch.randn(5, 8), torch.ones(4, 4, dtype=torch.bool)),
         ValueError, r"mask must have shape \(5, 5\).*\(4, 4\)"),
        (lambda: GraphAttentionLayer(8)(torch.randn(5, 8), torch.ones(5, 5)), TypeError, "bool"),
        (lambda: GraphAttentionLayer(8)(torch.randn(5, 8, dtype=torch.float64),
                                        torch.ones(5, 5, dtype=torch.bool)), TypeError, "dtype"),
    ],
)
def test_errors(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()
