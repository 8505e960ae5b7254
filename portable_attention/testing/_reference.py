"""An independent reference for attention: the dense formula in float64 NumPy, written plainly.

:func:`reference_attention` shares no code with the package's kernels (``_core``,
``masks``, the backends): it reads the contract (docs/contract.md) and computes it the
obvious way, one step per line, on the whole score matrix in double precision. It is the
oracle of the consistency report and of :func:`check_attention`, and it is meant for
your own tests too: a bug shared by the package's portable code and its fused paths
cannot hide behind it.

Only the conversion of the inputs to NumPy (``to_numpy``) comes from the package.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from portable_attention._convert import to_numpy


class Reference(NamedTuple):
    """What :func:`reference_attention` returns: three float64 NumPy arrays.

    Attributes
    ----------
    out : numpy.ndarray ``[..., Hq, Lq, Dv]``
        The attention output; exactly 0 on query rows with no key.
    weights : numpy.ndarray ``[..., Hq, Lq, Lk]``
        The softmax probabilities; exactly 0 on masked keys and on rows with no key.
    lse : numpy.ndarray ``[..., Hq, Lq]``
        The natural-log logsumexp of the masked scores; ``-inf`` on rows with no key.
    """

    out: np.ndarray
    weights: np.ndarray
    lse: np.ndarray


def reference_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    causal: bool | str = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Reference:
    """The contract's attention in float64 NumPy, for checking any implementation.

    Takes the arguments of :func:`portable_attention.attend` (those that define the
    result; not dropout or the path options), as arrays of any framework: they are
    converted to float64 NumPy (``mask`` to bool), exactly, so pass the very inputs your
    implementation computed with (rounded to its dtype) and the difference is the
    computation's.

    Parameters
    ----------
    q : array ``[..., Hq, Lq, Dk]`` (or ``[Lq, Dk]``)
    k : array ``[..., Hk, Lk, Dk]``
        ``Hq % Hk == 0``: query head ``h`` reads key/value head ``h // (Hq // Hk)``.
    v : array ``[..., Hk, Lk, Dv]``
    mask : bool array, optional
        Broadcastable to ``[..., Hq, Lq, Lk]``; True means "may attend".
    bias : float array, optional
        Broadcastable to ``[..., Hq, Lq, Lk]``; added to the scores after ``softcap``.
        A score of ``-inf`` masks its key.
    causal : bool or {"lower_right", "upper_left"}
        True is "lower_right": query ``i`` sees keys ``j <= i + (Lk - Lq)``;
        "upper_left": ``j <= i``.
    window : int or (left, right), optional
        Keys from ``left`` before to ``right`` after the query's aligned position
        (``i + (Lk - Lq)``, or ``i`` with ``causal="upper_left"``); None for a side: no
        bound there. An int ``w`` is ``(w, w)``.
    scale : float, optional
        Default ``1 / sqrt(Dk)``.
    softcap : float, optional
        Scores become ``softcap * tanh(scores / softcap)``.

    Returns
    -------
    Reference
        ``(out, weights, lse)`` as float64 NumPy arrays. A query row with no key left
        (masked out, outside the band, or every score ``-inf``) gets ``out = 0``,
        ``weights = 0`` and ``lse = -inf``.

    Raises
    ------
    ValueError
        Shapes that do not fit together, or an option out of its range.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attention.testing import reference_attention
    >>> q = np.zeros((1, 3, 2))
    >>> k = v = np.arange(4.0).reshape(1, 2, 2)
    >>> ref = reference_attention(q, k, v, causal=True)  # Lq=3 > Lk=2: row 0 sees no key
    >>> ref.out[0].tolist(), ref.lse[0].tolist()
    ([[0.0, 0.0], [0.0, 1.0], [1.0, 2.0]], [-inf, 0.0, 0.6931471805599453])
    """
    q, k, v = (to_numpy(x, dtype="float64") for x in (q, k, v))
    _check_shapes(q, k, v)
    alignment = _causal(causal)
    left, right = _window(window)

    two_d = q.ndim == 2
    if two_d:  # one head
        q, k, v = q[None], k[None], v[None]
    hq, lq, dk = q.shape[-3:]
    hk, lk = k.shape[-3], k.shape[-2]

    # Grouped-query heads: query head h reads key/value head h // (Hq // Hk).
    kv_head = np.arange(hq) // (hq // hk)
    k = np.take(k, kv_head, axis=-3)
    v = np.take(v, kv_head, axis=-3)

    if scale is None:
        scale = 1.0 / math.sqrt(dk)
    scores = scale * np.matmul(q, np.swapaxes(k, -1, -2))  # [..., Hq, Lq, Lk]
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    if bias is not None:
        scores = scores + _broadcast("bias", to_numpy(bias, dtype="float64"), scores.shape)

    allowed = scores != -np.inf  # a -inf score (from the bias) masks its key; NaN stays
    if mask is not None:
        mask_np = to_numpy(mask)
        if mask_np.dtype != np.bool_:
            msg = f"`mask` must be boolean (True = may attend), got dtype {mask_np.dtype}."
            raise ValueError(msg)
        allowed = allowed & _broadcast("mask", mask_np, scores.shape)
    allowed = allowed & _band(lq, lk, alignment, left, right)

    # The softmax over the allowed keys of each row, max subtracted; no key: 0 and -inf.
    has_key = allowed.any(axis=-1, keepdims=True)
    kept = np.where(allowed, scores, -np.inf)
    row_max = np.where(has_key, kept.max(axis=-1, keepdims=True), 0.0)
    exp = np.where(allowed, np.exp(np.where(allowed, scores - row_max, 0.0)), 0.0)
    total = exp.sum(axis=-1, keepdims=True)
    weights = np.where(has_key, exp / np.where(has_key, total, 1.0), 0.0)
    lse = np.where(has_key, row_max + np.log(np.where(has_key, total, 1.0)), -np.inf)[..., 0]
    out = np.matmul(weights, v)

    if two_d:
        out, weights, lse = out[0], weights[0], lse[0]
    return Reference(out, weights, lse)


def _band(lq: int, lk: int, causal: str | None, left: int | None, right: int | None) -> np.ndarray:
    """``[Lq, Lk]``: True where query ``i`` may see key ``j`` by ``causal`` (None: not
    causal) and the window."""
    i = np.arange(lq)[:, None]
    j = np.arange(lk)[None, :]
    aligned = i if causal == "upper_left" else i + (lk - lq)  # the key "at" query i
    band = np.ones((lq, lk), dtype=bool)
    if causal is not None:
        band &= j <= aligned
    if left is not None:
        band &= j >= aligned - left
    if right is not None:
        band &= j <= aligned + right
    return band


def _causal(causal: object) -> str | None:
    """``causal`` as its alignment, or None for no causal mask."""
    if isinstance(causal, (bool, np.bool_)):
        return "lower_right" if causal else None
    if causal in ("lower_right", "upper_left"):
        return str(causal)
    msg = f"`causal` must be False, True, 'lower_right' or 'upper_left', got {causal!r}."
    raise ValueError(msg)


def _window(window: object) -> tuple[int | None, int | None]:
    if window is None:
        return None, None
    sides = (window, window) if isinstance(window, (int, np.integer)) else window
    if not isinstance(sides, (tuple, list)) or len(sides) != 2:
        msg = f"`window` must be an int, (left, right) or None, got {window!r}."
        raise ValueError(msg)
    for side in sides:
        if side is not None and (
            isinstance(side, bool) or not isinstance(side, (int, np.integer)) or side < 0
        ):
            msg = f"`window` sides must be ints >= 0 or None, got {window!r}."
            raise ValueError(msg)
    left, right = sides
    return (None if left is None else int(left)), (None if right is None else int(right))


def _check_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    shapes = f"q {q.shape}, k {k.shape}, v {v.shape}"
    if not (q.ndim == k.ndim == v.ndim >= 2):
        msg = f"`q`, `k`, `v` must have one rank >= 2, got {shapes}."
        raise ValueError(msg)
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-3] != v.shape[:-3]:
        msg = f"`q`, `k`, `v` must have the same leading dims, got {shapes}."
        raise ValueError(msg)
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        msg = f"`q` and `k` need one Dk and `k` and `v` one Lk, got {shapes}."
        raise ValueError(msg)
    if q.ndim > 2:
        hq, hk = q.shape[-3], k.shape[-3]
        if k.shape[-3] != v.shape[-3] or hk == 0 or hq % hk:
            msg = f"`q`'s heads must be a multiple of `k`'s and `v`'s (Hq % Hk == 0), got {shapes}."
            raise ValueError(msg)


def _broadcast(name: str, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    try:
        return np.broadcast_to(a, shape)
    except ValueError:
        msg = f"`{name}` of shape {a.shape} does not broadcast to the scores {shape}."
        raise ValueError(msg) from None
