"""An interpolated n-gram language model: the counting baseline that a small neural model must beat.

An n-gram model predicts token t from the ``order - 1`` tokens before it, by counting. The
maximum-likelihood estimate of each order k (1 = no context, 2 = one token back, ...),

    q_k(w | h) = c(h, w) / c(h, .),

is sharp where its context h was seen often and undefined where it was never seen, so the orders
are mixed, each order falling back on the one below it (Jelinek and Mercer's linear
interpolation; Chen and Goodman, 1999, compare it with the other smoothing methods):

    p_0(w)       = 1 / V                                   (the uniform distribution)
    p_k(w | h_k) = lam_k q_k(w | h_k) + (1 - lam_k) p_{k-1}(w | h_{k-1})   if c(h_k, .) > 0
    p_k(w | h_k) = p_{k-1}(w | h_{k-1})                                    otherwise,

where h_k is the last k - 1 tokens. Every p_k sums to 1 over the vocabulary, for every context.
The weights lam_1, ..., lam_n are not learned on the counts' own text (there the highest order is
always right, and would take all the weight) but on other text, by expectation-maximization
(`InterpolatedNGram.fit_weights`): each scored token's probability is a mixture of the orders'
estimates, and EM alternates between each order's share of each token (E) and the weights that
those shares imply (M), a step that never lowers the likelihood of that text.

Shapes: ids are 1-D sequences of ints in [0, V) (a list, a tuple or a 1-D integer tensor);
`nll` gives a float64 tensor (N - 1,), `distribution` a float64 tensor (V,).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._validation import InputTypeError, require_int, type_name

__all__ = ["InterpolatedNGram"]


def _as_ids(name: str, ids: object, vocab_size: int) -> torch.Tensor:
    """``ids`` as a 1-D int64 tensor, each in [0, vocab_size)."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InputTypeError(f"{name} must hold integer ids, got {type_name(ids)}")
        t = ids.detach().to("cpu", torch.int64)
    elif isinstance(ids, Sequence) and not isinstance(ids, (str, bytes)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise InputTypeError(f"{name} must be a sequence of int ids")
        t = torch.tensor(list(ids), dtype=torch.int64)
    else:
        raise InputTypeError(f"{name} must be a list or a 1-D tensor of ids, got "
                             f"{type_name(ids)}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (N,), got {t.dim()} dims")
    if t.numel() and (t.min() < 0 or t.max() >= vocab_size):
        raise ValueError(f"{name} must be ids in [0, {vocab_size}), got values from "
                         f"{int(t.min())} to {int(t.max())}")
    return t


def _keys(ids: torch.Tensor, k: int, vocab_size: int) -> torch.Tensor:
    """The k-grams of ``ids`` (N,) as one int64 each, base ``vocab_size``: (N - k + 1,)."""
    n = ids.numel() - k + 1
    key = torch.zeros(max(n, 0), dtype=torch.int64)
    for j in range(k):
        key = key * vocab_size + ids[j:j + n]
    return key


def _lookup(keys: torch.Tensor, counts: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The count of each key of ``query`` in the sorted ``keys`` (0 where absent)."""
    if keys.numel() == 0:
        return torch.zeros(query.shape, dtype=torch.float64)
    at = torch.searchsorted(keys, query).clamp(max=keys.numel() - 1)
    return torch.where(keys[at] == query, counts[at], 0.0)


def _check_weights(weights: object, order: int) -> torch.Tensor:
    """``weights`` as a float64 tensor (order,), each in [0, 1]."""
    try:
        w = torch.as_tensor(weights, dtype=torch.float64).flatten().clone()
    except (TypeError, ValueError):
        raise InputTypeError(f"weights must be {order} numbers, got "
                             f"{type_name(weights)}") from None
    if w.numel() != order:
        raise ValueError(f"weights must be {order} numbers (one per order), got {w.numel()}")
    if not bool(((w >= 0) & (w <= 1)).all()):
        raise ValueError(f"weights must lie in [0, 1], got {w.tolist()}")
    return w


Counts = list[tuple[torch.Tensor, torch.Tensor]]


def _components(grams: Counts, contexts: Counts, ids: torch.Tensor, vocab_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each target t = 1 .. N - 1 of ``ids`` (N,): the estimate q_k of every order
    (N - 1, n + 1), column 0 the uniform one, and whether order k's context was seen
    (N - 1, n + 1). ``grams[k - 1]`` and ``contexts[k - 1]`` are order k's sorted keys and
    counts."""
    V, n, order = vocab_size, ids.numel() - 1, len(grams)
    q = torch.zeros(n, order + 1, dtype=torch.float64)
    seen = torch.zeros(n, order + 1, dtype=torch.bool)
    q[:, 0], seen[:, 0] = 1.0 / V, True
    for k in range(1, order + 1):
        # targets t >= k - 1 have the k - 1 tokens of context that order k needs
        if k - 1 > n:
            break
        keys = _keys(ids, k, V)[1:] if k == 1 else _keys(ids, k, V)
        rows = slice(max(k - 1, 1) - 1, n)
        totals = _lookup(*contexts[k - 1], keys // V)
        found = _lookup(*grams[k - 1], keys)
        ok = totals > 0
        q[rows, k] = torch.where(ok, found / totals.clamp(min=1.0), 0.0)
        seen[rows, k] = ok
    return q, seen


def _mix(weights: torch.Tensor, q: torch.Tensor, seen: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixing coefficient alpha of every order for every target (T, n + 1), and
    p = sum_k alpha_k q_k (T,)."""
    alpha = torch.zeros_like(q)
    alpha[:, 0] = 1.0
    for k in range(1, q.shape[1]):
        lam = torch.where(seen[:, k], weights[k - 1], 0.0)
        alpha[:, :k] *= (1 - lam)[:, None]
        alpha[:, k] = lam
    return alpha, (alpha * q).sum(dim=1)


class InterpolatedNGram:
    """Interpolated (Jelinek-Mercer) n-gram model over a vocabulary of V token ids.

    Args:
        vocab_size: V, an int >= 1.
        order: n, the number of tokens in the longest n-gram (3: a trigram model), an int >= 1
            with V ** n < 2 ** 62 (each n-gram is stored as one int64).
        weights: lam_1, ..., lam_n, each in [0, 1] (default: 0.5 each); `fit_weights` sets
            them from held-out text.

    Use: ``InterpolatedNGram(V, 3).fit(train_ids)``, then `nll` or `distribution`.
    """

    def __init__(self, vocab_size: int, order: int = 3,
                 weights: Sequence[float] | torch.Tensor | None = None) -> None:
        self.vocab_size = require_int("vocab_size", vocab_size)
        self.order = require_int("order", order)
        if self.vocab_size ** self.order >= 2 ** 62:
            raise ValueError(f"vocab_size ** order must be below 2 ** 62 to store an n-gram as "
                             f"one int64, got {self.vocab_size} ** {self.order}")
        self.weights = torch.full((self.order,), 0.5, dtype=torch.float64)
        if weights is not None:
            self.weights = _check_weights(weights, self.order)
        # order k at index k - 1: sorted k-gram keys, counts; sorted contexts, totals
        self._grams: Counts = []
        self._contexts: Counts = []

    def fit(self, ids: Sequence[int] | torch.Tensor) -> InterpolatedNGram:
        """Count every k-gram (k = 1 .. n) of ``ids`` (N,), replacing earlier counts.

        Returns ``self``. ``ids`` must hold at least one token.
        """
        t = _as_ids("ids", ids, self.vocab_size)
        if t.numel() == 0:
            raise ValueError("ids must hold at least 1 token to count, got 0")
        V = self.vocab_size
        self._grams, self._contexts = [], []
        for k in range(1, self.order + 1):
            keys, counts = torch.unique(_keys(t, k, V), return_counts=True)
            self._grams.append((keys, counts.double()))
            # a context's total is what followed it: the sum of its k-grams' counts
            ctx, inverse = torch.unique(keys // V, return_inverse=True)
            totals = torch.zeros(ctx.numel(), dtype=torch.float64)
            totals.index_add_(0, inverse, counts.double())
            self._contexts.append((ctx, totals))
        return self

    def _require_fitted(self) -> None:
        if not self._grams:
            raise ValueError("the model has no counts yet: call fit(ids) first")

    def count(self, ngram: Sequence[int]) -> int:
        """How many times the k-gram ``ngram`` (1 <= k <= n ids) occurred in the counted text."""
        self._require_fitted()
        g = _as_ids("ngram", ngram, self.vocab_size)
        if not 1 <= g.numel() <= self.order:
            raise ValueError(f"ngram must hold 1 to {self.order} ids, got {g.numel()}")
        keys, counts = self._grams[g.numel() - 1]
        return int(_lookup(keys, counts, _keys(g, g.numel(), self.vocab_size)).item())

    def nll(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """-ln p(x_t | the up to n - 1 tokens before it) for t = 1 .. N - 1: float64 (N - 1,).

        Token 0 has no context and is not scored; token 1 is scored with one token of context,
        and so on up to n - 1 (the orders whose context is not there yet are left out).
        """
        self._require_fitted()
        t = _as_ids("ids", ids, self.vocab_size)
        if t.numel() < 2:
            return torch.zeros(0, dtype=torch.float64)
        q, seen = _components(self._grams, self._contexts, t, self.vocab_size)
        return -_mix(self.weights, q, seen)[1].log()

    def fit_weights(self, ids: Sequence[int] | torch.Tensor, iterations: int = 50
                    ) -> torch.Tensor:
        """Set the weights lam_1 .. lam_n that maximize the likelihood of ``ids`` (N,), text
        that was not counted, by ``iterations`` steps of EM; returns them (n,) float64.

        E-step: order k's share of target t is r_k = alpha_k q_k / p. M-step: lam_k is the
        share of order k among the orders up to k, summed over the targets that saw its context:
        lam_k = sum_t r_k / sum_t (r_0 + ... + r_k).
        """
        self._require_fitted()
        iterations = require_int("iterations", iterations)
        t = _as_ids("ids", ids, self.vocab_size)
        if t.numel() < 2:
            raise ValueError(f"ids must hold at least 2 tokens to fit weights, got {t.numel()}")
        q, seen = _components(self._grams, self._contexts, t, self.vocab_size)
        for _ in range(iterations):
            alpha, p = _mix(self.weights, q, seen)
            share = alpha * q / p[:, None]
            below = share.cumsum(dim=1)
            for k in range(1, self.order + 1):
                mask = seen[:, k]
                total = below[mask, k].sum()
                if total > 0:
                    self.weights[k - 1] = share[mask, k].sum() / total
        return self.weights.clone()

    def distribution(self, context: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """p(w | context) for every w: float64 (V,), summing to 1. Only the last n - 1 ids of
        ``context`` (any length, possibly empty) are used."""
        self._require_fitted()
        c = _as_ids("context", context, self.vocab_size)
        V = self.vocab_size
        p = torch.full((V,), 1.0 / V, dtype=torch.float64)
        for k in range(1, self.order + 1):
            if c.numel() < k - 1:
                break
            h = c[c.numel() - (k - 1):] if k > 1 else c[:0]
            ctx_key = _keys(h, k - 1, V) if k > 1 else torch.zeros(1, dtype=torch.int64)
            ctx_keys, ctx_totals = self._contexts[k - 1]
            total = _lookup(ctx_keys, ctx_totals, ctx_key).item()
            if total == 0:
                continue
            gram_keys, gram_counts = self._grams[k - 1]
            found = _lookup(gram_keys, gram_counts, ctx_key * V + torch.arange(V))
            lam = self.weights[k - 1]
            p = lam * found / total + (1 - lam) * p
        return p
