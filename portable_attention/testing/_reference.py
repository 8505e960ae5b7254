"""An independent reference for attention: the dense formula in float64 NumPy, written plainly.

:func:`reference_attention` shares no code with the package's kernels (``_core``,
``masks``, the backends): it reads the contract (docs/contract.md) and computes it the
obvious way, one step per line, on the whole score matrix in double precision (attention
sinks as one more score column, segment ids as a mask built from each position's segment,
``score_mod``/``mask_mod`` called once on that whole matrix). It is the
oracle of the consistency report and of :func:`check_attention`, and it is meant for
your own tests too: a bug shared by the package's portable code and its fused paths
cannot hide behind it.

Only the conversion of the inputs to NumPy (``to_numpy``) comes from the package.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from portable_attention.testing._convert import to_numpy


class Reference(NamedTuple):
    """What :func:`reference_attention` returns: three float64 NumPy arrays.

    Attributes
    ----------
    out : numpy.ndarray ``[..., Hq, Lq, Dv]``
        The attention output; exactly 0 on query rows with no key.
    weights : numpy.ndarray ``[..., Hq, Lq, Lk]``
        The softmax probabilities; exactly 0 on masked keys and on rows with no key. With
        ``sinks`` a row sums to less than 1: the sink's share is not a key's.
    lse : numpy.ndarray ``[..., Hq, Lq]``
        The natural-log logsumexp of the masked scores, the sink's logit included where
        ``sinks`` are given; ``-inf`` on rows with no key (the sink's logit with sinks).
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
    sinks: Any = None,
    segment_ids: Any = None,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
) -> Reference:
    """The contract's attention in float64 NumPy, for checking any implementation.

    Takes the arguments of :func:`portable_attention.attend` (those that define the
    result; not dropout or the path options), as arrays of any framework: they are
    converted to float64 NumPy (``mask`` to bool, ``segment_ids`` to int64), exactly, so
    pass the very inputs your implementation computed with (rounded to its dtype) and the
    difference is the computation's.

    The scores are, in order: ``scale * q @ k^T``, ``softcap``, ``+ bias``,
    ``score_mod``; then every mask removes keys (``mask``, ``causal``/``window``,
    ``segment_ids``, ``mask_mod`` and ``-inf`` scores, combined with logical and); then the
    softmax over the kept keys and the sink, and ``@ v``.

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
    sinks : float array, optional
        Attention sinks (gpt-oss): one logit per query head, broadcastable to
        ``q.shape[:-2]`` (``[..., Hq]``; ``()`` or ``(1,)`` for 2-D ``q``). It is appended
        to each row's masked scores as one more column, the row's softmax is taken, and
        the column is dropped: the weights sum to less than 1, ``lse`` includes the sink.
        A sink of ``-inf`` is no sink.
    segment_ids : int array or (int array, int array), optional
        Packed sequences: ``[*batch, L]`` for self-attention (``Lq == Lk``), or a pair
        ``(q_ids [*batch, Lq], kv_ids [*batch, Lk])``, ``*batch`` broadcastable to
        ``q.shape[:-3]`` (1-D ids for 2-D and 3-D ``q``). A query attends only the keys
        with its own id (a segment: all positions of one id, in each array and batch
        row). ``causal`` and ``window`` are aligned within it: each position's aligned
        coordinate is ``i - end(i)`` (``end``: one past the last position of its id in
        its array; "lower_right", the default) or ``i - start(i)`` (``start``: the first
        position of its id; ``causal="upper_left"``), and key ``j`` is kept for query
        ``i`` when ``-left <= pos(j) - pos(i) <= right`` (causal: ``right = 0``). For
        contiguous segments this is each segment's queries attending its keys alone.
    score_mod : callable, optional
        FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``, called once
        on NumPy arrays: ``score`` float64 ``[..., Hq, Lq, Lk]`` (``[Lq, Lk]`` for 2-D
        ``q``); int32 indices ``b`` ``[*batch, 1, 1, 1]`` (the row-major flat index over
        ``q.shape[:-3]``; zeros ``[1, 1, 1]`` for 3-D ``q``), ``h`` ``[*ones, Hq, 1, 1]``
        (``arange(Hq)``), ``q_idx`` ``[Lq, 1]``, ``kv_idx`` ``[1, Lk]`` (for 2-D ``q``,
        ``b`` and ``h`` are zeros ``[1, 1]``). The result must broadcast to ``score``'s
        shape; ``-inf`` masks.
    mask_mod : callable, optional
        FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool array`` (True = keep),
        called once with the indices of ``score_mod``; the result must broadcast to the
        scores' shape.

    Returns
    -------
    Reference
        ``(out, weights, lse)`` as float64 NumPy arrays. A query row with no key left
        (masked out, outside the band, or every score ``-inf``) gets ``out = 0``,
        ``weights = 0`` and ``lse = -inf`` (with ``sinks``: ``lse`` = the sink's logit).

    Raises
    ------
    ValueError
        Shapes that do not fit together, an option out of its range, a non-boolean
        ``mask`` or ``mask_mod`` result, non-integer ``segment_ids``.
    TypeError
        A ``score_mod`` or ``mask_mod`` that is not callable.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attention.testing import reference_attention
    >>> q = np.zeros((1, 3, 2))
    >>> k = v = np.arange(4.0).reshape(1, 2, 2)
    >>> ref = reference_attention(q, k, v, causal=True)  # Lq=3 > Lk=2: row 0 sees no key
    >>> ref.out[0].tolist(), ref.lse[0].tolist()
    ([[0.0, 0.0], [0.0, 1.0], [1.0, 2.0]], [-inf, 0.0, 0.6931471805599453])

    A sink of logit 0 takes a share ``1 / (1 + sum(exp(scores)))`` of each row:

    >>> ref = reference_attention(q, k, v, sinks=np.zeros(1))  # q is 0: the scores are 0
    >>> ref.weights[0, 0].tolist(), bool(ref.lse[0, 0] == np.log(3.0))
    ([0.3333333333333333, 0.3333333333333333], True)
    """
    q, k, v = (to_numpy(x, dtype="float64") for x in (q, k, v))
    _check_shapes(q, k, v)
    alignment = _causal(causal)
    left, right = _window(window)
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if mod is not None and not callable(mod):
            msg = f"`{name}` must be a callable or None, got {type(mod).__name__}."
            raise TypeError(msg)

    two_d = q.ndim == 2
    batch = q.shape[:-3]  # the batch dims (none for 2-D and 3-D q)
    if two_d:  # one head
        q, k, v = q[None], k[None], v[None]
    hq, lq, dk = q.shape[-3:]
    hk, lk = k.shape[-3], k.shape[-2]
    sink = None if sinks is None else _sinks(sinks, q.shape[:-2])  # [..., Hq]
    ids = None if segment_ids is None else _segment_ids(segment_ids, batch, lq, lk)

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
    indices = _mod_indices(batch, hq, lq, lk, two_d)
    if score_mod is not None:
        modded = score_mod(scores[0] if two_d else scores, *indices)
        modded = np.asarray(modded, dtype=np.float64)
        scores = _broadcast("score_mod", modded, scores.shape[1:] if two_d else scores.shape)
        scores = scores.reshape((1, lq, lk)) if two_d else scores

    allowed = scores != -np.inf  # a -inf score (bias, score_mod) masks its key; NaN stays
    if mask is not None:
        mask_np = to_numpy(mask)
        if mask_np.dtype != np.bool_:
            msg = f"`mask` must be boolean (True = may attend), got dtype {mask_np.dtype}."
            raise ValueError(msg)
        allowed = allowed & _broadcast("mask", mask_np, scores.shape)
    if ids is None:
        allowed = allowed & _band(lq, lk, alignment, left, right)
    else:
        allowed = allowed & _segment_band(*ids, alignment, left, right)  # [*batch, 1, Lq, Lk]
    if mask_mod is not None:
        keep = np.asarray(mask_mod(*indices))
        if keep.dtype != np.bool_:
            msg = f"`mask_mod` must return a boolean array (True = keep), got dtype {keep.dtype}."
            raise ValueError(msg)
        allowed = allowed & _broadcast(
            "mask_mod", keep, scores.shape[1:] if two_d else scores.shape
        )

    if sink is not None:  # the sink: one more column, in every row, never masked by a mask
        column = np.broadcast_to(sink[..., None, None], (*scores.shape[:-1], 1))
        scores = np.concatenate([scores, column], axis=-1)
        allowed = np.concatenate(
            [np.broadcast_to(allowed, (*scores.shape[:-1], lk)), column != -np.inf], axis=-1
        )

    # The softmax over the allowed keys of each row, max subtracted; no key: 0 and -inf.
    has_key = allowed.any(axis=-1, keepdims=True)
    kept = np.where(allowed, scores, -np.inf)
    row_max = np.where(has_key, kept.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)
    exp = np.where(allowed, np.exp(np.where(allowed, scores - row_max, 0.0)), 0.0)
    total = exp.sum(axis=-1, keepdims=True)
    weights = np.where(has_key, exp / np.where(has_key, total, 1.0), 0.0)
    lse = np.where(has_key, row_max + np.log(np.where(has_key, total, 1.0)), -np.inf)[..., 0]
    if sink is not None:
        weights = weights[..., :lk]  # the sink's column goes
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


def _segment_band(
    q_ids: np.ndarray,
    kv_ids: np.ndarray,
    causal: str | None,
    left: int | None,
    right: int | None,
) -> np.ndarray:
    """``[*batch, 1, Lq, Lk]``: True where query ``i`` and key ``j`` have one id and ``j``
    is in ``i``'s band, both positions counted within their own segment (id)."""
    upper_left = causal == "upper_left"
    pos_q = _position_in_segment(q_ids, upper_left)[..., None, :, None]
    pos_k = _position_in_segment(kv_ids, upper_left)[..., None, None, :]
    distance = pos_k - pos_q  # the key's aligned position minus the query's
    keep = q_ids[..., None, :, None] == kv_ids[..., None, None, :]
    if causal is not None:
        keep = keep & (distance <= 0)
    if left is not None:
        keep = keep & (distance >= -left)
    if right is not None:
        keep = keep & (distance <= right)
    return keep


def _position_in_segment(ids: np.ndarray, upper_left: bool) -> np.ndarray:
    """Each position's coordinate in its segment (all positions of its id): ``i -
    start(i)`` (upper-left: the id's first position), else ``i - end(i)`` (lower-right:
    one past the id's last position, so <= -1); along the last axis, per row."""
    index = np.arange(ids.shape[-1])
    same = ids[..., :, None] == ids[..., None, :]  # [*batch, L, L]: p and p' share an id
    if upper_left:
        start = np.where(same, index, ids.shape[-1]).min(axis=-1)
        return index - start
    end = np.where(same, index, -1).max(axis=-1) + 1
    return index - end


def _mod_indices(
    batch: tuple[int, ...], hq: int, lq: int, lk: int, two_d: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(b, h, q_idx, kv_idx)`` of ``score_mod``/``mask_mod``: int32, broadcasting to the
    scores ``[*batch, Hq, Lq, Lk]`` (``[Lq, Lk]`` for 2-D q)."""
    q_idx = np.arange(lq, dtype=np.int32).reshape(lq, 1)
    kv_idx = np.arange(lk, dtype=np.int32).reshape(1, lk)
    if two_d:
        zero = np.zeros((1, 1), dtype=np.int32)
        return zero, zero.copy(), q_idx, kv_idx
    b = np.arange(math.prod(batch), dtype=np.int32).reshape(*batch, 1, 1, 1)
    h = np.arange(hq, dtype=np.int32).reshape(*([1] * len(batch)), hq, 1, 1)
    return b, h, q_idx, kv_idx


def _sinks(sinks: Any, heads_shape: tuple[int, ...]) -> np.ndarray:
    """``sinks`` as float64 ``[..., Hq]`` (``q.shape[:-2]``)."""
    if isinstance(sinks, (int, float)) and not isinstance(sinks, bool):
        values = np.asarray(sinks, dtype=np.float64)
    else:
        values = to_numpy(sinks, dtype="float64")
    if values.ndim > len(heads_shape):
        msg = f"`sinks` of shape {values.shape} has more dims than q's heads {heads_shape}."
        raise ValueError(msg)
    return _broadcast("sinks", values, heads_shape)


def _segment_ids(
    segment_ids: Any, batch: tuple[int, ...], lq: int, lk: int
) -> tuple[np.ndarray, np.ndarray]:
    """``segment_ids`` (one array or a pair) as int64 ``([*batch, Lq], [*batch, Lk])``."""
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            msg = (
                "`segment_ids` must be an int array [*batch, L] or a pair (q_ids, kv_ids), "
                f"got a sequence of {len(segment_ids)}."
            )
            raise ValueError(msg)
        pair = [to_numpy(ids) for ids in segment_ids]
    else:
        if lq != lk:
            msg = (
                f"One `segment_ids` array needs Lq == Lk, got Lq {lq} and Lk {lk}: pass "
                "(q_ids, kv_ids)."
            )
            raise ValueError(msg)
        pair = [to_numpy(segment_ids)] * 2
    result = []
    for name, ids, length in zip(("q_ids", "kv_ids"), pair, (lq, lk), strict=True):
        if not np.issubdtype(ids.dtype, np.integer):
            msg = f"`segment_ids` ({name}) must be an integer array, got dtype {ids.dtype}."
            raise ValueError(msg)
        if ids.ndim < 1 or ids.shape[-1] != length:
            msg = f"`segment_ids` ({name}) must have shape [*batch, {length}], got {ids.shape}."
            raise ValueError(msg)
        if ids.ndim - 1 > len(batch):
            msg = f"`segment_ids` ({name}) {ids.shape} has more batch dims than q's {batch}."
            raise ValueError(msg)
        result.append(_broadcast(f"segment_ids ({name})", ids.astype(np.int64), (*batch, length)))
    return result[0], result[1]


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
