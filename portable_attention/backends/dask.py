"""dask.array: lazy, chunked NumPy (or CuPy) arrays; attend builds the graph, the user
computes it.

The portable and blockwise paths run on dask's array-API namespace (array-api-compat's)
unchanged. What differs from NumPy is that reading a value on the host would compute the
graph: so nothing here reads one. The blockwise path does not skip the blocks that
segment ids or a ``mask_mod`` mask entirely (that needs a host read per block; a block
plan's static skipping still applies), and the mask builders skip their value checks,
as they do under ``jax.jit`` (``total=`` is then required). Dropout draws its masks from
a NumPy Generator, as the generic adapter does.
"""

from __future__ import annotations

import math
from typing import Any

import dask.array as da

from portable_attention import _spec
from portable_attention.backends._base import Kernel
from portable_attention.backends.generic import GenericAdapter


class PerChunk(Kernel):
    """``attend`` of each chunk's own arrays (NumPy's kernel on NumPy chunks, CuPy's on
    CuPy's) as one task per chunk of the batch and head axes: the sequence and feature
    axes are joined into one chunk each (a no-op where they are already), K/V's heads
    chunked to match q's groups."""

    path = "per-chunk:dask"
    why = (
        "attend runs on each batch/head chunk's own arrays (one task per chunk: NumPy's "
        "kernel on NumPy chunks), the sequence axis whole within each"
    )

    def reason(self, call: _spec.Call) -> str | None:
        if call.mask_shape is not None or call.bias_shape is not None:
            return "a mask or bias runs on the portable path (their chunks need aligning)"
        if call.modded or call.dropout > 0 or call.return_weights:
            return "segment ids, mods, dropout and return_weights run on the portable path"
        if len(call.q_shape) < 3:
            return "q, k, v without a head axis run on the portable path"
        return None

    def run(
        self,
        call: _spec.Call,
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        bias: Any,
        keep: Any,
        mods: Any = None,
    ) -> tuple[Any, Any, Any]:
        from portable_attention import attend

        group = call.q_shape[-3] // call.k_shape[-3]
        q = q.rechunk({-3: _whole_groups(q.chunks[-3], group), -2: -1, -1: -1})
        heads = tuple(n // group for n in q.chunks[-3])  # each q chunk's K/V heads
        k, v = (
            x.rechunk({**dict(enumerate(q.chunks[:-3])), -3: heads, -2: -1, -1: -1}) for x in (k, v)
        )
        dv = call.v_shape[-1]
        compute = call.compute_dtype
        causal, window, scale, softcap = call.causal or False, call.window, call.scale, call.softcap

        def chunk(qc: Any, kc: Any, vc: Any) -> Any:
            out, lse = attend(
                qc, kc, vc, causal=causal, window=window, scale=scale, softcap=softcap,
                return_lse=True,
            )  # fmt: skip
            xp = _spec.namespace_of("q", qc)
            return xp.concat([xp.astype(out, lse.dtype), lse[..., None]], axis=-1)

        packed = da.map_blocks(
            chunk,
            q,
            k,
            v,
            dtype=compute,
            chunks=(*q.chunks[:-1], (dv + 1,)),
            meta=q._meta.astype(compute),
        )
        return packed[..., :dv].astype(call.dtype), None, packed[..., dv]


def _whole_groups(chunks: tuple[int, ...], group: int) -> tuple[int, ...]:
    """q's head chunks joined where needed so that each holds whole groups of ``group``
    query heads (those of one K/V head)."""
    joined, held = [], 0
    for n in chunks:
        held += n
        if held % group == 0:
            joined.append(held)
            held = 0
    return tuple(joined)


class DaskAdapter(GenericAdapter):
    """dask.array: the generic adapter that never computes its arrays, and ``attend`` per
    chunk where the call allows."""

    name = "dask"
    tuned = PerChunk()

    def host_bool(self, x: Any) -> bool | None:
        return None  # bool(x) would compute the graph

    def traced(self, x: Any) -> bool:
        return True

    def check_array(self, name: str, x: Any) -> None:
        if any(isinstance(n, float) and math.isnan(n) for n in x.shape):
            msg = (
                f"`{name}` is a dask array of unknown chunk sizes (shape {tuple(x.shape)}), "
                "from a boolean index or a filter; attend needs the shapes to plan the call: "
                f"call `{name}.compute_chunk_sizes()` first (it computes what the chunks hold)."
            )
            raise ValueError(msg)


ADAPTER = DaskAdapter()
