"""A plain float64 NumPy reference for attention, written independently of the package.

It does not import ``portable_attention``. It follows DESIGN.md / docs/api-decisions.md
literally and favours the obvious formulation over speed:

* grouped-query heads by repeating K/V heads (``np.repeat``), query head h uses KV head
  ``h // (Hq // Hk)``;
* causal and window masks from explicit index comparisons;
* a max-subtracted softmax that explicitly writes 0 for rows with no key left;
* lse = log-sum-exp of the masked scores, exactly ``-inf`` for those rows.

Also a central finite-difference gradient of a scalar loss of the oracle (for grad tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def allowed_positions(
    lq: int,
    lk: int,
    *,
    causal: bool | str = False,
    window: int | tuple[int | None, int | None] | None = None,
) -> np.ndarray:
    """Boolean [lq, lk]: True where query i may see key j because of causal/window options."""
    if causal is True or causal == "lower_right":
        offset = lk - lq
        is_causal = True
    elif causal == "upper_left":
        offset = 0
        is_causal = True
    elif causal is False:
        offset = lk - lq  # window alignment without causal: lower-right
        is_causal = False
    else:
        msg = f"oracle: bad causal {causal!r}"
        raise ValueError(msg)

    if isinstance(window, int):
        left, right = window, window
    elif window is None:
        left, right = None, None
    else:
        left, right = window

    i = np.arange(lq)[:, None]  # query index
    j = np.arange(lk)[None, :]  # key index
    p = i + offset  # each query's aligned key position
    keep = np.ones((lq, lk), dtype=bool)
    if is_causal:
        keep &= j <= p
    if left is not None:
        keep &= j >= p - left
    if right is not None:
        keep &= j <= p + right
    return keep


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    causal: bool | str = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(out, weights, lse)`` in float64 for the given (float64-convertible) inputs."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    two_d = q.ndim == 2
    if two_d:
        q, k, v = q[None], k[None], v[None]

    hq, hk = q.shape[-3], k.shape[-3]
    assert hq % hk == 0, (hq, hk)
    group = hq // hk
    k = np.repeat(k, group, axis=-3)
    v = np.repeat(v, group, axis=-3)

    lq, dk = q.shape[-2], q.shape[-1]
    lk = k.shape[-2]
    if scale is None:
        scale = 1.0 / np.sqrt(dk)

    scores = scale * np.einsum("...qd,...kd->...qk", q, k)
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)

    keep = np.ones(scores.shape, dtype=bool)
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float64)
        scores = scores + bias
        keep = keep & (scores != -np.inf)
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        keep = keep & mask
    keep = keep & allowed_positions(lq, lk, causal=causal, window=window)

    # Stable softmax, row by row over the last axis; rows with no key are written as 0 / -inf.
    any_key = keep.any(axis=-1, keepdims=True)
    masked_scores = np.where(keep, scores, -np.inf)
    row_max = np.where(any_key, masked_scores.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)
    exp = np.where(keep, np.exp(np.where(keep, scores, 0.0) - row_max), 0.0)
    denom = exp.sum(axis=-1, keepdims=True)
    weights = np.where(any_key, exp / np.where(any_key, denom, 1.0), 0.0)
    lse = np.where(
        any_key[..., 0], row_max[..., 0] + np.log(np.where(any_key, denom, 1.0)[..., 0]), -np.inf
    )
    out = np.einsum("...qk,...kd->...qd", weights, v)
    out = np.where(any_key, out, 0.0)

    if two_d:
        out, weights, lse = out[0], weights[0], lse[0]
    return out, weights, lse


def numerical_grad(f: Callable[[], float], x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central finite differences of the scalar ``f()`` with respect to ``x`` (modified in place,
    restored afterwards)."""
    g = np.zeros_like(x, dtype=np.float64)
    flat = x.reshape(-1)
    gflat = g.reshape(-1)
    for idx in range(flat.size):
        old = flat[idx]
        flat[idx] = old + h
        fp = f()
        flat[idx] = old - h
        fm = f()
        flat[idx] = old
        gflat[idx] = (fp - fm) / (2 * h)
    return g


def loss_grads(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    w_out: np.ndarray,
    w_lse: np.ndarray | None = None,
    **kwargs: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Finite-difference gradients wrt q, k, v of
    ``sum(out * w_out) + sum(where(isfinite(lse), lse, 0) * w_lse)``."""
    q, k, v = (np.array(a, dtype=np.float64, copy=True) for a in (q, k, v))

    def f() -> float:
        out, _, lse = attention(q, k, v, **kwargs)
        total = float(np.sum(out * w_out))
        if w_lse is not None:
            total += float(np.sum(np.where(np.isfinite(lse), lse, 0.0) * w_lse))
        return total

    return numerical_grad(f, q), numerical_grad(f, k), numerical_grad(f, v)


def loss_grads_with_bias(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    w_out: np.ndarray,
    w_lse: np.ndarray | None = None,
    *,
    bias: np.ndarray | None = None,
    **kwargs: Any,
) -> dict[str, np.ndarray]:
    """Finite-difference gradients of the loss of :func:`loss_grads` with respect to q, k,
    v and (where given) the bias, in its own (broadcast) shape: ``{"q": ..., "bias": ...}``.
    A ``-inf`` bias entry stays ``-inf`` when nudged, so its gradient is 0."""
    arrays = {
        n: np.array(a, dtype=np.float64, copy=True) for n, a in zip("qkv", (q, k, v), strict=True)
    }
    if bias is not None:
        arrays["bias"] = np.array(bias, dtype=np.float64, copy=True)

    def f() -> float:
        out, _, lse = attention(
            arrays["q"], arrays["k"], arrays["v"], bias=arrays.get("bias"), **kwargs
        )
        total = float(np.sum(out * w_out))
        if w_lse is not None:
            total += float(np.sum(np.where(np.isfinite(lse), lse, 0.0) * w_lse))
        return total

    return {name: numerical_grad(f, a) for name, a in arrays.items()}
