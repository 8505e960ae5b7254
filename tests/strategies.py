"""Hypothesis strategies that draw whole ``attend`` calls, and their independent references.

A drawn :class:`Case` holds only shapes, options and seeds (so a failing example prints as a
short, reproducible line); the arrays come from a NumPy Generator seeded by ``Case.seed``.
:meth:`Case.arrays` makes them on a backend (masks built there, with the package's mask
builders or as raw boolean arrays) and :meth:`Case.reference` runs the float64 oracle on the
values the backend actually holds (inputs after the cast to the case's dtype), with every
mask computed again here in NumPy, independently of ``portable_attention.masks``.

What is drawn: ranks 2-5, batch dims 0-3, grouped (``Hq % Hk == 0``) and multi-query heads,
``Lq``/``Lk`` from 0 to 300 (mostly at most 9, one in four drawn up to 300), ``Dk`` 1-16,
``Dv`` 0-16 (often ``!= Dk``), every floating dtype the backend has (float16/bfloat16 with
their tolerances), masks (raw random booleans of any broadcastable shape,
``causal_mask``, ``window_mask``, ``key_padding_mask``, ``padding_mask_from_tokens``,
``segment_mask``, and fully masked query rows or a fully masked batch/head joined by
``masks.combine``), additive biases (with ``-inf`` entries and ``-inf`` rows, in the input or
the compute dtype), ``causal`` (both alignments), ``window``, ``scale``, ``softcap`` and chunk
sizes.

JAX compiles every operation afresh for each new shape (about 1 s per eager call here), so on
JAX the dims come from :data:`JAX_DIMS`, a fixed menu that covers the same cases (every rank,
GQA and MQA, ``Lq != Lk``, empty sequences, several blocks, ``Dk != Dv``, 600 queries for the
``tuned:jax`` query-blocked kernel); everything else is drawn as on the other backends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st
from portable_attention import masks

import oracle
from conftest import HALF, Backend, compute_dtype_name

PATHS = ("auto", "portable", "fused", "chunked")
CAUSAL = (False, True, "lower_right", "upper_left")


@dataclass(frozen=True)
class Dims:
    """Shapes of one call: ``q [*lead, Hq, Lq, Dk]``, ``k``/``v [*lead, Hk, Lk, Dk|Dv]``;
    rank 2 (``heads is None``) is ``q [Lq, Dk]``."""

    lead: tuple[int, ...]
    heads: tuple[int, int] | None  # (Hq, Hk)
    lq: int
    lk: int
    dk: int
    dv: int

    def _head(self, i: int) -> tuple[int, ...]:
        return () if self.heads is None else (self.heads[i],)

    @property
    def q_shape(self) -> tuple[int, ...]:
        return (*self.lead, *self._head(0), self.lq, self.dk)

    @property
    def k_shape(self) -> tuple[int, ...]:
        return (*self.lead, *self._head(1), self.lk, self.dk)

    @property
    def v_shape(self) -> tuple[int, ...]:
        return (*self.lead, *self._head(1), self.lk, self.dv)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (*self.q_shape[:-1], self.dv)

    @property
    def score_shape(self) -> tuple[int, ...]:
        return (*self.q_shape[:-1], self.lk)

    @property
    def scores(self) -> int:
        return math.prod(self.score_shape)

    def __repr__(self) -> str:
        return f"Dims(q={self.q_shape}, k={self.k_shape}, v={self.v_shape})"


def _d(lead: tuple[int, ...], heads: tuple[int, int] | None, lq: int, lk: int, dk: int, dv: int):
    return Dims(lead, heads, lq, lk, dk, dv)


#: The dims drawn on JAX (see the module docstring).
JAX_DIMS = (
    _d((), None, 5, 7, 4, 3),
    _d((), (4, 2), 6, 6, 8, 8),
    _d((2,), (4, 1), 7, 5, 4, 4),
    _d((1, 2), (2, 2), 4, 9, 8, 8),
    _d((2,), (2, 2), 4, 0, 4, 3),
    _d((1,), (2, 1), 37, 70, 8, 8),
    _d((1,), (2, 1), 600, 24, 8, 8),  # tuned:jax (512+ queries): 2 blocks of 256 and a tail
)
#: Dtypes drawn on JAX: mostly float32, the one its fused path and gradients take.
JAX_DTYPES = ("float32", "float32", "float32", "float64", "float16", "bfloat16")
#: Chunk sizes drawn on JAX (each block's slices compile anew).
JAX_CHUNKS = (3, 16)


def _lengths() -> st.SearchStrategy[int]:
    # one_of shrinks towards its first branch; three small branches out of four.
    small = st.integers(0, 9)
    return st.one_of(small, small, small, st.integers(10, 300))


@st.composite
def dims(draw: st.DrawFn, backend_name: str) -> Dims:
    if backend_name == "jax":
        return draw(st.sampled_from(JAX_DIMS))
    rank = draw(st.integers(2, 5))
    lq, lk = draw(_lengths()), draw(_lengths())
    dk = draw(st.integers(1, 16))
    dv = draw(st.one_of(st.just(dk), st.integers(0, 16)))
    big = lq * lk > 400  # keep large sequences to few heads and batches
    heads = None
    if rank >= 3:
        hk = draw(st.integers(1, 2 if big else 3))
        heads = (hk * draw(st.integers(1, 2 if big else 3)), hk)
    batch = st.sampled_from((1,) if big else (1, 2, 3) * 4 + (0,))  # an empty batch at times
    lead = tuple(draw(batch) for _ in range(max(rank - 3, 0)))
    return Dims(lead, heads, lq, lk, dk, dv)


def _broadcast_shape(draw: st.DrawFn, full: tuple[int, ...], few: bool) -> tuple[int, ...]:
    """A shape that broadcasts to ``full``: leading dims dropped, others kept or set to 1
    (``few``: only ``full`` itself or its last two dims, to limit JAX's compilations)."""
    if few:
        return draw(st.sampled_from((full, full[-2:])))
    ndim = draw(st.integers(1, len(full)))
    return tuple(n if draw(st.booleans()) else 1 for n in full[len(full) - ndim :])


# ------------------------------------------------------------------------------------------
# Masks


@dataclass(frozen=True)
class MaskSpec:
    """A mask: ``kind`` says how the backend builds it; ``expected`` recomputes it in NumPy.

    Kinds: ``raw`` (random booleans of ``shape`` with ``density`` True), ``causal`` and
    ``window`` (``masks.causal_mask`` / ``masks.window_mask`` with ``align``), ``key_padding``
    (``masks.key_padding_mask(lengths)``), ``tokens`` (``masks.padding_mask_from_tokens`` of
    random ids, pad id 0), ``segments`` (``masks.segment_mask`` of sorted random ids), ``none``.
    ``kill_rows`` (query rows) and ``kill_first`` (index 0 of the scores' first axis: a batch,
    or a head at rank 3) are masked entirely by a raw mask joined with ``masks.combine``.
    """

    kind: str
    seed: int
    shape: tuple[int, ...] = ()
    density: float = 0.5
    align: str = "lower_right"
    window: Any = None
    kill_rows: tuple[int, ...] = ()
    kill_first: bool = False

    def _parts(self, d: Dims) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        batch = d.score_shape[-4] if len(d.score_shape) >= 4 else 1
        if self.kind == "raw":
            return {"mask": rng.random(self.shape) < self.density}
        if self.kind == "key_padding":
            return {"lengths": rng.integers(0, d.lk + 1, size=batch)}
        if self.kind == "tokens":
            return {"tokens": (rng.random((batch, d.lk)) >= self.density) * rng.integers(1, 9)}
        if self.kind == "segments":
            qs = np.sort(rng.integers(0, 3, size=(batch, d.lq)), axis=-1)
            ks = np.sort(rng.integers(0, 3, size=(batch, d.lk)), axis=-1)
            return {"q": qs, "k": ks}
        return {}

    def _kill(self, d: Dims) -> np.ndarray | None:
        if not self.kill_rows and not self.kill_first:
            return None
        full = d.score_shape
        kill = np.ones((*full[:-1], 1) if self.kill_first else (d.lq, 1), dtype=bool)
        for r in self.kill_rows:
            kill[..., r, :] = False
        if self.kill_first:
            kill[0] = False
        return kill

    def expected(self, d: Dims) -> np.ndarray | None:
        """The mask in NumPy, computed without ``portable_attention``."""
        parts = self._parts(d)
        lq, lk = d.lq, d.lk
        base: np.ndarray | None
        if self.kind == "none":
            base = None
        elif self.kind == "raw":
            base = parts["mask"]
        elif self.kind == "causal":
            base = oracle.allowed_positions(lq, lk, causal=self.align)
        elif self.kind == "window":
            base = _band(lq, lk, self.window, self.align)
        elif self.kind == "key_padding":
            base = (np.arange(lk)[None, :] < parts["lengths"][:, None])[:, None, None, :]
        elif self.kind == "tokens":
            base = (parts["tokens"] != 0)[:, None, None, :]
        elif self.kind == "segments":
            base = (parts["q"][:, :, None] == parts["k"][:, None, :])[:, None]
        else:
            raise AssertionError(self.kind)
        kill = self._kill(d)
        if kill is None:
            return base
        return kill if base is None else (base & kill)

    def build(self, backend: Backend, d: Dims) -> Any:
        """The mask as the backend's array, made by the package's builders where it can."""
        parts = self._parts(d)
        xp, dev = backend.xp, backend.device
        if self.kind == "none":
            base = None
        elif self.kind == "raw":
            base = backend.asarray(parts["mask"])
        elif self.kind == "causal":
            base = masks.causal_mask(d.lq, d.lk, align=self.align, xp=xp, device=dev)
        elif self.kind == "window":
            base = masks.window_mask(d.lq, d.lk, self.window, align=self.align, xp=xp, device=dev)
        elif self.kind == "key_padding":
            base = masks.key_padding_mask(backend.asarray(parts["lengths"]), d.lk)
        elif self.kind == "tokens":
            base = masks.padding_mask_from_tokens(backend.asarray(parts["tokens"]), 0)
        elif self.kind == "segments":
            base = masks.segment_mask(backend.asarray(parts["q"]), backend.asarray(parts["k"]))
        else:
            raise AssertionError(self.kind)
        kill = self._kill(d)
        if kill is None:
            return base
        return masks.combine(base, backend.asarray(kill))

    def __repr__(self) -> str:
        extra = {
            "shape": self.shape if self.kind == "raw" else None,
            "density": self.density if self.kind in ("raw", "tokens") else None,
            "align": self.align if self.kind in ("causal", "window") else None,
            "window": self.window,
            "kill_rows": self.kill_rows or None,
            "kill_first": self.kill_first or None,
        }
        shown = ", ".join(f"{k}={v!r}" for k, v in extra.items() if v is not None)
        return f"MaskSpec({self.kind!r}, seed={self.seed}{', ' if shown else ''}{shown})"


def _band(lq: int, lk: int, window: Any, align: str) -> np.ndarray:
    """``window_mask`` by index comparison: keys within the window of the aligned query."""
    left, right = (window, window) if isinstance(window, int) else window
    i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
    p = i + (lk - lq if align == "lower_right" else 0)
    keep = np.ones((lq, lk), dtype=bool)
    if left is not None:
        keep &= j >= p - left
    if right is not None:
        keep &= j <= p + right
    return keep


def windows() -> st.SearchStrategy[Any]:
    side = st.one_of(st.none(), st.integers(0, 6))
    return st.one_of(st.integers(0, 6), st.tuples(side, side))


@st.composite
def mask_specs(draw: st.DrawFn, d: Dims, *, empty_rows: bool = False) -> MaskSpec:
    kinds = ["none", "raw", "raw", "causal", "window"]
    if len(d.score_shape) >= 4:
        kinds += ["key_padding", "tokens", "segments"]
    kind = draw(st.sampled_from(kinds))
    seed = draw(st.integers(0, 2**16))
    few = d in JAX_DIMS
    shape = _broadcast_shape(draw, d.score_shape, few) if kind == "raw" else ()
    density = draw(st.sampled_from((0.1, 0.5, 0.9))) if kind in ("raw", "tokens") else 0.5
    align = draw(st.sampled_from(("lower_right", "upper_left")))
    window = draw(windows()) if kind == "window" else None
    kill_rows: tuple[int, ...] = ()
    if d.lq and (empty_rows or draw(st.integers(0, 3)) == 0):
        kill_rows = tuple(sorted(draw(st.sets(st.integers(0, d.lq - 1), min_size=1, max_size=3))))
    kill_first = len(d.score_shape) >= 3 and d.score_shape[0] > 0 and draw(st.integers(0, 5)) == 0
    return MaskSpec(kind, seed, shape, density, align, window, kill_rows, kill_first)


# ------------------------------------------------------------------------------------------
# Biases


@dataclass(frozen=True)
class BiasSpec:
    """An additive bias of ``shape`` (normal * ``amp``), ``-inf`` with probability
    ``neg_inf`` and on the query rows ``inf_rows`` (where the shape has them); its dtype is
    the inputs' or the compute dtype (``compute``)."""

    shape: tuple[int, ...]
    seed: int
    amp: float
    neg_inf: float
    inf_rows: tuple[int, ...]
    compute: bool

    def values(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        b = rng.standard_normal(self.shape) * self.amp
        b[rng.random(self.shape) < self.neg_inf] = -np.inf
        if len(self.shape) >= 2 and self.shape[-2] > 1:
            for r in self.inf_rows:
                b[..., r, :] = -np.inf
        return b

    def dtype(self, dtype: str) -> str:
        return compute_dtype_name(dtype) if self.compute else dtype


@st.composite
def bias_specs(draw: st.DrawFn, d: Dims, dtype: str) -> BiasSpec:
    shape = _broadcast_shape(draw, d.score_shape, d in JAX_DIMS)
    inf_rows: tuple[int, ...] = ()
    if len(shape) >= 2 and shape[-2] > 1 and draw(st.booleans()):
        inf_rows = tuple(sorted(draw(st.sets(st.integers(0, shape[-2] - 1), max_size=2))))
    return BiasSpec(
        shape=shape,
        seed=draw(st.integers(0, 2**16)),
        amp=draw(st.sampled_from((0.5, 2.0))),
        neg_inf=draw(st.sampled_from((0.0, 0.0, 0.2, 0.9))),
        inf_rows=inf_rows,
        compute=dtype in HALF and draw(st.booleans()),
    )


# ------------------------------------------------------------------------------------------
# Whole calls


@dataclass(frozen=True)
class Case:
    """One call of ``attend`` (without the path): dims, dtype, data seed, mask, bias, options."""

    dims: Dims
    dtype: str
    seed: int
    spread: float
    mask: MaskSpec | None
    bias: BiasSpec | None
    causal: bool | str
    window: Any
    scale: float | None
    softcap: float | None
    chunk: int

    def numpy_qkv(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q and k scaled so that the scores' standard deviation is ``self.spread``; v normal.

        (The dtype tolerances hold for scores of a few units: float32 errors grow with
        ``|scores| * |v|``, and scores of 100 would need wider ones.)
        """
        rng = np.random.default_rng(self.seed)
        d = self.dims
        scale = self.scale if self.scale is not None else 1 / math.sqrt(d.dk)
        amp = math.sqrt(self.spread / (scale * math.sqrt(d.dk)))
        return (
            rng.standard_normal(d.q_shape) * amp,
            rng.standard_normal(d.k_shape) * amp,
            rng.standard_normal(d.v_shape),
        )

    def options(self) -> dict[str, Any]:
        return {
            "causal": self.causal,
            "window": self.window,
            "scale": self.scale,
            "softcap": self.softcap,
        }

    def path_kwargs(self, path: str) -> dict[str, Any]:
        """``implementation``/``chunk_size`` arguments of a path from :data:`PATHS`."""
        if path == "chunked":
            return {"implementation": "auto", "chunk_size": self.chunk}
        return {"implementation": path}

    def arrays(self, backend: Backend) -> tuple[Any, Any, Any, Any, Any]:
        """``(q, k, v, mask, bias)`` on the backend (mask and bias may be None)."""
        q, k, v = (backend.asarray(a, self.dtype) for a in self.numpy_qkv())
        mask = None if self.mask is None else self.mask.build(backend, self.dims)
        bias = None
        if self.bias is not None:
            bias = backend.asarray(self.bias.values(), self.bias.dtype(self.dtype))
        return q, k, v, mask, bias

    def expected_mask(self) -> np.ndarray | None:
        return None if self.mask is None else self.mask.expected(self.dims)

    def reference(
        self, backend: Backend, arrays: tuple[Any, ...]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The oracle's float64 ``(out, weights, lse)`` on the values the backend holds."""
        q, k, v, _, bias = arrays
        return oracle.attention(
            *(backend.to_numpy(a) for a in (q, k, v)),
            mask=self.expected_mask(),
            bias=None if bias is None else backend.to_numpy(bias),
            **self.options(),
        )


@st.composite
def cases(
    draw: st.DrawFn,
    backend: Backend,
    *,
    dtypes: tuple[str, ...] | None = None,
    empty_rows: bool = False,
) -> Case:
    """A whole call for ``backend``; ``empty_rows`` makes some query rows lose every key."""
    d = draw(dims(backend.name))
    names = dtypes or (JAX_DTYPES if backend.name == "jax" else ("float32", "float64", *HALF))
    names = tuple(n for n in names if n in backend.dtypes)
    dtype = draw(st.sampled_from(names))
    has_mask = empty_rows or draw(st.booleans())
    mask = draw(mask_specs(d, empty_rows=empty_rows)) if has_mask else None
    bias = draw(bias_specs(d, dtype)) if draw(st.integers(0, 2)) == 0 else None
    causal = draw(st.sampled_from(CAUSAL))
    window = draw(st.one_of(st.none(), st.none(), windows()))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    softcap = draw(st.one_of(st.none(), st.none(), st.floats(0.5, 30.0)))
    chunk = draw(st.sampled_from(JAX_CHUNKS) if backend.name == "jax" else st.integers(1, 64))
    blocks = 2 if backend.name == "jax" else 6  # JAX compiles every block's slices anew
    chunk = max(chunk, -(-max(d.lq, d.lk) // blocks))  # at most 6x6 (JAX: 2x2) blocks
    return Case(
        dims=d,
        dtype=dtype,
        seed=draw(st.integers(0, 2**16)),
        spread=draw(st.sampled_from((0.3, 1.0, 4.0))),
        mask=mask,
        bias=bias,
        causal=causal,
        window=window,
        scale=scale,
        softcap=softcap,
        chunk=chunk,
    )
