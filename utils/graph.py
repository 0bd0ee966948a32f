"""Attention on graphs: the adjacency matrix as an attention mask (chapter 11).

A graph's nodes are a set of vectors, one per node, exactly what self-attention takes as input.
Full self-attention would let every node look at every other one; a graph says which pairs are
related. Using the adjacency matrix (with self-loops, so that a node also keeps its own vector) as
the bool attention mask makes each node attend to its neighbours only: graph attention, in the
spirit of Velickovic et al. (2018), with the Transformer's scaled dot-product score.

Shapes: node vectors (N, d_model) or (B, N, d_model); a mask (N, N) or (B, N, N), True where
node i (the query) may attend to node j (the key), the book's mask convention.
"""

from __future__ import annotations

import torch
from torch import nn

from ._validation import (
    InputTypeError,
    require_bool,
    require_bool_mask,
    require_choice,
    require_int,
    require_like_module,
    require_rank,
    require_same_device,
    require_tensor,
    shape_str,
)
from .attention import MultiHeadAttention

__all__ = ["adjacency_mask", "GraphAttentionLayer"]


def _edge_index_adjacency(edges: torch.Tensor, num_nodes: int, undirected: bool) -> torch.Tensor:
    """(2, E) integer edge list -> (N, N) bool adjacency."""
    if edges.dtype == torch.bool or edges.is_floating_point() or edges.is_complex():
        raise InputTypeError(
            f"an edge list (num_nodes given) must hold integer node ids, got dtype {edges.dtype} "
            f"with shape {shape_str(edges)}; pass a square adjacency matrix without num_nodes"
        )
    require_rank("edges", edges, "(2, E)", rank=2)
    if edges.shape[0] != 2:
        raise ValueError(f"an edge list must have shape (2, E) (sources, then targets), got "
                         f"{shape_str(edges)}")
    if edges.numel() > 0:
        low, high = int(edges.min()), int(edges.max())
        if low < 0 or high >= num_nodes:
            raise ValueError(f"edge list node ids must be in [0, num_nodes={num_nodes}), got "
                             f"values from {low} to {high}")
    adjacency = torch.zeros(num_nodes, num_nodes, dtype=torch.bool, device=edges.device)
    adjacency[edges[0], edges[1]] = True
    if undirected:
        adjacency[edges[1], edges[0]] = True
    return adjacency


def adjacency_mask(edges: torch.Tensor, num_nodes: int | None = None, self_loops: bool = True,
                   undirected: bool = True) -> torch.Tensor:
    """The (N, N) bool attention mask of a graph: True where node i may attend to node j.

    Give the graph either as an **edge list** with ``num_nodes``: an integer tensor of shape
    (2, E) whose column ``e`` is the edge from ``edges[0, e]`` to ``edges[1, e]`` (the layout of
    PyTorch Geometric's ``edge_index``); or as a square **adjacency matrix** without
    ``num_nodes``: shape (N, N), bool or numeric, nonzero where there is an edge (for example
    ``torch.from_numpy(networkx.to_numpy_array(graph))``).

    Args:
        edges: the edge list (2, E) or the adjacency matrix (N, N).
        num_nodes: N for an edge list; None for an adjacency matrix.
        self_loops: put True on the diagonal, so that every node also attends to itself (without
            it a node keeps nothing of its own vector, and an isolated node attends to nothing).
        undirected: for an edge list, add every edge in both directions; for an adjacency
            matrix, make it symmetric (A or A^T).

    Returns:
        A bool tensor of shape (N, N), on ``edges``' device.

    Raises:
        InputTypeError: for a non-tensor, an edge list that does not hold integers, or flags that
            are not bools.
        ValueError: for an edge list that is not (2, E) or names a node outside [0, N), or an
            adjacency matrix that is not square.
    """
    require_tensor("edges", edges)
    require_bool("self_loops", self_loops)
    require_bool("undirected", undirected)
    if num_nodes is not None:
        num_nodes = require_int("num_nodes", num_nodes)
        mask = _edge_index_adjacency(edges, num_nodes, undirected)
    else:
        require_rank("edges", edges, "(N, N) (an adjacency matrix; for an edge list (2, E) pass "
                     "num_nodes)", rank=2)
        if edges.shape[0] != edges.shape[1]:
            raise ValueError(
                f"an adjacency matrix must be square (N, N), got {shape_str(edges)}; for an edge "
                "list of shape (2, E) pass num_nodes"
            )
        mask = edges != 0
        if undirected:
            mask = mask | mask.T
    if self_loops:
        mask = mask | torch.eye(mask.shape[0], dtype=torch.bool, device=mask.device)
    return mask


class GraphAttentionLayer(nn.Module):
    """One layer of graph attention: multi-head self-attention over the nodes, masked by the graph.

    ``out = activation(x + MultiHeadAttention(x, x, x, mask))`` (without ``residual``, the ``x +``
    is left out). Each node's new vector is a weighted average of the value vectors of the nodes
    its mask row allows, its neighbours, so one layer passes information one hop along the edges
    and ``k`` layers pass it ``k`` hops. The scores are the Transformer's scaled dot products;
    the original graph attention network scores a pair with a small additive network instead.

    Args:
        d_model: width of the node vectors, a positive int.
        num_heads: heads h, a positive int dividing ``d_model``.
        dropout: dropout on the attention weights during training, in [0, 1).
        residual: add the input to the attention's output.
        activation: ``"elu"`` (as in the graph attention network), ``"relu"`` or ``"none"``.

    Shapes:
        x (N, d_model) or (B, N, d_model); mask (N, N) or (B, N, N) bool, True = node i may attend
        to node j (`adjacency_mask`) -> output of x's shape. The attention weights of the last
        call are in ``attn.attn_weights``, (B, h, N, N).
    """

    def __init__(self, d_model: int, num_heads: int = 1, dropout: float = 0.0,
                 residual: bool = True, activation: str = "elu"):
        super().__init__()
        # keep_weights: the layer is small and its weights are what one looks at on a graph.
        self.attn = MultiHeadAttention(d_model, num_heads, dropout=dropout, keep_weights=True)
        self.d_model = self.attn.d_model
        self.residual = require_bool("residual", residual)
        self.activation = require_choice("activation", activation, ("elu", "relu", "none"))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attend from every node to the nodes its row of ``mask`` allows.

        Args:
            x: node vectors, (N, d_model) or (B, N, d_model), the parameters' dtype and device.
            mask: bool (N, N), shared by the batch, or (B, N, N); True = may attend. A node whose
                row is all False gets a zero attention output (never NaN).

        Returns:
            The new node vectors, the shape of ``x``.

        Raises:
            InputTypeError: for a non-tensor, a dtype or device other than the parameters', or a
                mask that is not bool.
            ValueError: for shapes that do not fit: x not (N, d_model) or (B, N, d_model), or a
                mask not (N, N) or (B, N, N) for x's B and N.
        """
        require_tensor("x", x)
        require_tensor("mask", mask)
        if x.dim() not in (2, 3) or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (N, d_model={self.d_model}) or "
                             f"(B, N, d_model={self.d_model}), got {shape_str(x)}")
        require_like_module("x", x, self)
        require_bool_mask("mask", mask)
        unbatched = x.dim() == 2
        xb = x[None] if unbatched else x
        b, n = xb.shape[0], xb.shape[1]
        if mask.shape not in ((n, n), (b, n, n)):
            expected = f"({n}, {n})" if unbatched else f"({n}, {n}) or ({b}, {n}, {n})"
            raise ValueError(f"mask must have shape {expected} for x of shape {shape_str(x)}, "
                             f"got {shape_str(mask)}")
        require_same_device(x=x, mask=mask)
        # A 3-dim mask is never ambiguous (a 2-dim one could be read as key padding when B == N).
        out = self.attn(xb, xb, xb, mask=mask if mask.dim() == 3 else mask[None])
        if self.residual:
            out = xb + out
        if self.activation == "elu":
            out = nn.functional.elu(out)
        elif self.activation == "relu":
            out = torch.relu(out)
        return out[0] if unbatched else out
