"""NumPy: its adapter (dropout from a ``numpy.random.Generator``, the generic adapter's
RNG; NumPy's scalars and masked arrays refused by name). NumPy has no fused attention:
``auto`` runs the blockwise path from 64K scores on (the dense path below), with its steps
in place (:mod:`~portable_attention.backends.numpy_math`), a forward step over a long span
of key blocks where none needs a mask (:data:`SPAN_SCORES`), and its large calls' query
blocks on worker threads (:mod:`~portable_attention.backends.numpy_loop`).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from portable_attention import _core, _spec
from portable_attention._block_loop import BlockLoop
from portable_attention._block_math import BlockMath
from portable_attention._checks import shape_of, type_name
from portable_attention.backends._base import MemoKeys
from portable_attention.backends.generic import GenericAdapter
from portable_attention.backends.numpy_math import InPlaceMath

#: From this many scores on (over batch and heads), ``auto`` runs NumPy's calls on the
#: blockwise path; below, the dense one (:meth:`NumpyAdapter.blockwise_reason`).
BLOCKWISE_MIN_SCORES = 1 << 16
#: Scores per step of the forward, over all batch and head dims (16 MiB of float32), where
#: the ``causal``/``window`` band does not cut consecutive key blocks
#: (``BlockLoop.key_span``).
SPAN_SCORES = 1 << 22
#: Below this many scores in all, threads cost more than they give
#: (:mod:`~portable_attention.backends.numpy_loop`).
THREADS_MIN_SCORES = 1 << 22


class NumpyAdapter(GenericAdapter):
    """NumPy: the generic adapter's dropout (a ``numpy.random.Generator``), NumPy's
    scalars and masked arrays refused, the blockwise path from 64K scores on, its steps
    in place, its loops NumPy's."""

    name = "NumPy"

    def blockwise_reason(self, call: _spec.Call) -> str | None:
        # Below 64K scores the dense path's fewer Python steps win (decode, 8 heads x 512
        # keys: 66 us against 112; [1, 8, 128, 128]: 536 against 445 the other way).
        if _core.score_count(call) < BLOCKWISE_MIN_SCORES:
            return None
        return (
            "NumPy runs the blockwise path's steps in place, over long spans of keys where "
            "the causal/window band does not cut them"
        )

    def block_loop(self, call: _spec.Call) -> BlockLoop:
        if _core.score_count(call) < THREADS_MIN_SCORES or call.dropout:
            return BlockLoop(call.xp, call.device, span_scores=SPAN_SCORES)
        from portable_attention.backends.numpy_loop import NumpyLoop

        return NumpyLoop(call.xp, call.device, span_scores=SPAN_SCORES)

    def check_array(self, name: str, x: Any) -> None:
        # NumPy scalars are not arrays (as Python scalars are not); a masked array's mask
        # would be ignored silently.
        if isinstance(x, np.generic):
            msg = (
                f"`{name}` must be an array of your framework, got the NumPy scalar {x!r} of "
                f"type {type_name(x)}; convert it first, e.g. `xp.asarray({name})`."
            )
            raise TypeError(msg)
        if isinstance(x, np.ma.MaskedArray):
            msg = (
                f"`{name}` is a numpy.ma.MaskedArray {shape_of(x)}, whose mask attend would "
                f"ignore; pass `{name}.filled(0.0)` (plain data) and express what is masked "
                "out with `mask=` (boolean, True = may attend)."
            )
            raise TypeError(msg)

    def device(self, x: Any) -> Any:
        return "cpu"

    def unshifted_exp(self, call: _spec.Call) -> bool:
        return True

    def block_math(self, xp: Any, arrays: tuple[Any, ...]) -> BlockMath:
        # NumPy records nothing for autodiff: the blockwise steps may always write in
        # place (into arrays the loop made, never the inputs).
        return InPlaceMath(xp)

    def memo_keys(self) -> MemoKeys:
        return _shape_dtype, _qkv_key


_shape_dtype = operator.attrgetter("shape", "dtype")  # NumPy arrays are always on the CPU


def _qkv_key(q: Any, k: Any, v: Any) -> tuple[Any, ...]:
    return (type(k), type(v), q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype)


ADAPTER = NumpyAdapter()
