"""NumPy's in-place steps of the blockwise path (:class:`InPlaceMath`), which
:meth:`portable_attention.backends.numpy.NumpyAdapter.block_math` gives the one kernel.

Each step writes into the block the loop made (ufuncs with ``out=``) instead of allocating
a fresh array and passing over memory once more. Measured on this project's 2-core AMD
EPYC, OpenBLAS on one thread, CPU time of ``attend_backward`` (causal, softcap 20,
``[1, 8, L, 64]`` float32, medians of warm runs, alternating processes): L=512 29.1 ms
functional against 17.1 ms in place (1.7x), L=2048 227 ms against 212 ms (1.07x); the
``chunk_size`` forward at L=2048 (blocks of 512) 155 ms against 120 ms.

The product buffers outlive the call (one per slot and dtype per thread, up to 4 MiB):
fresh arrays cost page faults and, when freed, TLB shootdowns on the cores where the
BLAS's threads spin; with them kept, and the row sums taken as a matrix-vector product,
and the forward's first try without the max (``Adapter.unshifted_exp``), the causal
forward at L=128 (blocks of 64) took 0.66 ms against 1.41 before (same conditions,
docs/fast-paths.md).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from portable_attention._block_math import BlockMath

#: The largest buffer a thread keeps per slot for the next call. Fresh arrays cost page
#: faults and, when freed, TLB shootdowns on the cores where the BLAS's threads spin.
BUFFER_MAX_BYTES = 1 << 22
_local = threading.local()


class InPlaceMath(BlockMath):
    """The blockwise path's steps with NumPy's ufuncs writing into their first argument
    (see :mod:`portable_attention._block_math` for what a step may overwrite). A step
    whose other operand would broadcast the block to a larger shape or promote it to a
    wider dtype takes the functional form."""

    def tanh(self, s: Any) -> Any:
        return np.tanh(s, out=s)

    def scaled(self, s: Any, factor: float) -> Any:
        return np.multiply(s, factor, out=s)

    def product(self, a: Any, b: Any, *, slot: str | None = None) -> Any:
        if slot is None or a.shape[:-2] != b.shape[:-2] or a.dtype != b.dtype:
            return np.matmul(a, b)
        return np.matmul(a, b, out=self._buffer(slot, (*a.shape[:-1], b.shape[-1]), a.dtype))

    def scaled_copy(self, t: Any, factor: float) -> Any:
        return np.multiply(t, factor, out=self._buffer("scaled", t.shape, t.dtype))

    def _buffer(self, slot: str, shape: tuple[int, ...], dtype: Any) -> Any:
        """The slot's buffer for this thread, kept from call to call up to
        :data:`BUFFER_MAX_BYTES` (a larger product is a fresh array each step: at
        ``[2, 32, 1024, 64]`` with blocks of 256, 32 MiB each, no slower)."""
        size = math.prod(shape)
        dtype = np.dtype(dtype)
        if size * dtype.itemsize > BUFFER_MAX_BYTES:
            return np.empty(shape, dtype)
        buffers = _local.__dict__.setdefault("buffers", {})
        buffer = buffers.get((slot, dtype))
        if buffer is None or buffer.size < size:
            buffer = buffers[slot, dtype] = np.empty(size, dtype)
        return buffer[:size].reshape(shape)

    #: ``np.exp2``: 222 us where ``np.exp`` took 475 for [8, 256, 512] float32 scores
    #: (AVX-512 EPYC, NumPy 2); float32 only (:func:`_blockwise.base2_scores`).
    base2 = True

    def exp(self, s: Any, *, base2: bool = False) -> Any:
        # Without a max subtracted (the forward's first try, checked after: see
        # _blockwise._unshifted_held), exp may overflow: NumPy's warning would only alarm.
        with np.errstate(over="ignore"):
            return (np.exp2 if base2 else np.exp)(s, out=s)

    def row_sum(self, e: Any) -> Any:
        # A matrix-vector product: 11 us for [8, 128, 128] float32, e.sum(-1) took 41.
        return np.matmul(e, np.ones((e.shape[-1], 1), e.dtype))

    def exp_shifted(self, s: Any, shift: Any, *, base2: bool = False) -> Any:
        if not _fits(s, shift):
            s = s - shift
        else:
            np.subtract(s, shift, out=s)
        return (np.exp2 if base2 else np.exp)(s, out=s)

    def masked(self, s: Any, allow: Any) -> Any:
        if not _fits(s, allow):
            return super().masked(s, allow)
        np.copyto(s, -np.inf, where=np.logical_not(allow))
        return s

    def zeroed(self, p: Any, allow: Any) -> Any:
        # A copy, not a product with the mask: a NaN where a key is masked (a cache's
        # unwritten slots) must give 0 there, not NaN.
        if not _fits(p, allow):
            return super().zeroed(p, allow)
        np.copyto(p, 0.0, where=np.logical_not(allow))
        return p

    def add(self, acc: Any, x: Any) -> Any:
        with np.errstate(over="ignore", invalid="ignore"):  # (as in exp: inf + -inf)
            return np.add(acc, x, out=acc) if _fits(acc, x) else acc + x

    def matmul_add(self, acc: Any, a: Any, b: Any, *, slot: str | None = None) -> Any:
        # The forward's first product into its slot's buffer: a fresh [8, 128, 64] float32
        # accumulator each query block (mmap, page faults, TLB shootdowns where OpenBLAS's
        # threads spin) made [1, 8, 128, 64] take 0.84 ms against 0.47 (docs/benchmarks.md).
        with np.errstate(over="ignore", invalid="ignore"):  # (as in add)
            product = self.product(a, b, slot=slot if acc is None else "matmul_add")
        return product if acc is None else self.add(acc, product)

    def mul(self, a: Any, b: Any) -> Any:
        return np.multiply(a, b, out=a) if _fits(a, b) else a * b

    def divided(self, a: Any, b: Any) -> Any:
        return np.divide(a, b, out=a) if _fits(a, b) else a / b

    def softcap_grad(self, ds: Any, t: Any) -> Any:
        if not _fits(ds, t):
            return super().softcap_grad(ds, t)
        np.multiply(t, t, out=t)
        np.subtract(1.0, t, out=t)
        return np.multiply(ds, t, out=ds)


def _fits(block: Any, x: Any) -> bool:
    """Whether ``block`` may take ``block op x`` in place: ``x`` (an array or a scalar)
    neither broadcasts it to a larger shape nor promotes its dtype."""
    shape = getattr(x, "shape", ())
    if shape != block.shape:
        pairs = zip(reversed(shape), reversed(block.shape), strict=False)
        if len(shape) > block.ndim or any(n not in (1, m) for n, m in pairs):
            return False
    return np.result_type(block, x) == block.dtype
