"""The elementwise steps of the blockwise path's inner loops (and of the dense path, its
one-block case), as one small interface.

:mod:`portable_attention._blockwise` computes every block's scores, probabilities and
gradients through a :class:`BlockMath`. This class is the array-API default: every step
returns a new array. An adapter whose framework can update an array in place passes a
subclass that does (``Adapter.block_math``): on a ``[8, 256, 256]`` float32 block, torch's
``a * b`` took 131 us against 48 us for ``a.mul_(b)`` on this project's 2-core machine (a
pass over memory and a fresh buffer less), and both passes of the blockwise path make
several such steps per block. :class:`OutMath` writes those steps in place once, for
every framework whose functions take ``out=`` (NumPy's and torch's subclasses).

The contract a subclass may rely on:

- Every method except :meth:`~BlockMath.product` and :meth:`~BlockMath.scaled_copy` may
  overwrite its **first argument** and return it. That argument is an array the blockwise
  loop made itself, never an input of ``attend``, never an array that autodiff records,
  and the caller reads its old value no more: a block of scores or probabilities made in
  the same step, or an accumulator (``acc``, a row sum, a block of ``dq``) that the result
  replaces. :meth:`~BlockMath.softcap_grad` may overwrite ``t`` as well.
- :meth:`~BlockMath.product` and :meth:`~BlockMath.scaled_copy` only read their
  arguments; their result may be a buffer that the next call (of the same slot) writes
  again, so the caller uses it within the step (the first product of
  :meth:`~BlockMath.matmul_add` given a slot: within the outer block, the forward's
  query block, whose output is a new array).
- Arguments after the first are only read.
"""

from __future__ import annotations

import contextlib
from typing import Any

import array_api_compat


class BlockMath:
    """The functional steps (array API); see the module docstring."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp

    def tanh(self, s: Any) -> Any:
        """``tanh(s)``."""
        return self.xp.tanh(s)

    def scaled(self, s: Any, factor: float) -> Any:
        """``factor * s``."""
        return factor * s

    def product(self, a: Any, b: Any, *, slot: str | None = None) -> Any:
        """``a @ b``. With a ``slot`` name the result is the caller's only until the next
        product of that slot (a subclass may write each into one buffer)."""
        return self.xp.matmul(a, b)

    def scaled_copy(self, t: Any, factor: float) -> Any:
        """``factor * t``, leaving ``t`` as it is. The result is the caller's only until
        the next call of this method (a subclass may write each into one buffer)."""
        return factor * t

    #: Whether :meth:`exp` and :meth:`exp_shifted` take ``base2=True`` (``2**s``), where
    #: it is faster than ``exp`` in float32: the forward then folds ``log2(e)`` into q.
    base2 = False

    def exp(self, s: Any, *, base2: bool = False) -> Any:
        """``exp(s)`` (``2**s`` with ``base2``, asked only where :attr:`base2` says so)."""
        return 2.0**s if base2 else self.xp.exp(s)

    def row_sum(self, e: Any) -> Any:
        """``e``'s sums over its last axis, that axis kept (length 1)."""
        return self.xp.sum(e, axis=-1, keepdims=True)

    def exp_shifted(self, s: Any, shift: Any, *, base2: bool = False) -> Any:
        """``exp(s - shift)`` (``shift`` broadcasts: one value per row; ``2**(s -
        shift)`` with ``base2``)."""
        return 2.0 ** (s - shift) if base2 else self.xp.exp(s - shift)

    def masked(self, s: Any, allow: Any) -> Any:
        """``s`` with ``-inf`` where ``allow`` (which broadcasts to ``s``) is False."""
        return self.xp.where(allow, s, -self.xp.inf)

    def zeroed(self, p: Any, allow: Any) -> Any:
        """``p`` with 0 where ``allow`` (which broadcasts to ``p``) is False, whatever
        ``p`` holds there (a NaN included: not a product with the mask)."""
        return self.xp.where(allow, p, 0.0)

    def add(self, acc: Any, x: Any) -> Any:
        """``acc + x`` (of the same shape)."""
        return acc + x

    def matmul_add(self, acc: Any, a: Any, b: Any, *, slot: str | None = None) -> Any:
        """``acc + a @ b`` (``a @ b`` where ``acc`` is None; ``a @ b`` of ``acc``'s shape).
        With a ``slot`` name, ``a @ b`` where ``acc`` is None may be written into a buffer
        (as :meth:`product`'s): the caller's until the next call of that slot."""
        product = self.xp.matmul(a, b)
        return product if acc is None else acc + product

    def mul(self, a: Any, b: Any) -> Any:
        """``a * b`` (``b`` of ``a``'s shape, or broadcasting to it)."""
        return a * b

    def divided(self, a: Any, b: Any) -> Any:
        """``a / b`` (``b`` of ``a``'s shape, or broadcasting to it)."""
        return a / b

    def softcap_grad(self, ds: Any, t: Any) -> Any:
        """``ds * (1 - t**2)``: the gradient through ``softcap * tanh``. ``t`` is the
        block's ``tanh``, made in the same step: a subclass may overwrite it too."""
        return ds * (1.0 - t * t)


class OutMath(BlockMath):
    """The steps written in place, once, for a framework whose functions take ``out=``
    (NumPy's ufuncs and ``matmul``, torch's functions): ``ops`` is its own namespace
    (``numpy``, ``torch``; not array-api-compat's, whose functions take no ``out=``, and
    whose ``result_type`` took 6 us on torch where ``torch.promote_types`` took 0.3). A
    step whose other operand would broadcast the block to a larger shape or promote it to
    a wider dtype takes the functional form (:meth:`fits`). A subclass gives how a mask
    fills a block (:meth:`fill`) and may keep its product buffers longer
    (:meth:`buffer`)."""

    def __init__(self, xp: Any, ops: Any) -> None:
        super().__init__(xp)
        self.ops = ops
        self._buffers: dict[tuple[str, Any], Any] = {}

    def fill(self, x: Any, where: Any, value: float) -> Any:
        """``x`` with ``value`` written where ``where`` (which broadcasts to it) is True."""
        raise NotImplementedError

    def buffer(self, slot: str, shape: tuple[int, ...], like: Any) -> Any:
        """An array of ``shape`` and ``like``'s dtype for the slot's products: here one per
        slot, reused while this object lives (a pass's blocks) and its shape and dtype
        stay. On the 2-core machine a fresh [8, 256, 256] torch product of a scalar and a
        block took 220 us, one into the reused buffer 100 us."""
        key = (slot, like.dtype)
        buffer = self._buffers.get(key)
        if buffer is None or tuple(buffer.shape) != tuple(shape):
            device = array_api_compat.device(like)
            buffer = self._buffers[key] = self.xp.empty(shape, dtype=like.dtype, device=device)
        return buffer

    def quiet(self) -> Any:
        """A context in which overflow (``exp`` without a max subtracted: the forward's
        first try) and ``inf - inf`` warn of nothing (NumPy's ``errstate``)."""
        return contextlib.nullcontext()

    def fits(self, block: Any, x: Any) -> bool:
        """Whether ``block`` may take ``block op x`` in place: ``x`` (an array or a Python
        scalar) neither broadcasts it to a larger shape nor promotes its dtype."""
        shape = tuple(getattr(x, "shape", ()))
        if shape != tuple(block.shape):
            pairs = zip(reversed(shape), reversed(block.shape), strict=False)
            if len(shape) > block.ndim or any(n not in (1, m) for n, m in pairs):
                return False
        dtype = getattr(x, "dtype", block.dtype)
        return dtype == block.dtype or self.ops.promote_types(block.dtype, dtype) == block.dtype

    def tanh(self, s: Any) -> Any:
        return self.ops.tanh(s, out=s)

    def scaled(self, s: Any, factor: float) -> Any:
        return self.ops.multiply(s, factor, out=s)

    def product(self, a: Any, b: Any, *, slot: str | None = None) -> Any:
        if slot is None or a.shape[:-2] != b.shape[:-2] or a.dtype != b.dtype:
            return self.ops.matmul(a, b)
        return self.ops.matmul(a, b, out=self.buffer(slot, (*a.shape[:-1], b.shape[-1]), a))

    def scaled_copy(self, t: Any, factor: float) -> Any:
        return self.ops.multiply(t, factor, out=self.buffer("scaled", t.shape, t))

    def exp(self, s: Any, *, base2: bool = False) -> Any:
        with self.quiet():
            return (self.ops.exp2 if base2 else self.ops.exp)(s, out=s)

    def exp_shifted(self, s: Any, shift: Any, *, base2: bool = False) -> Any:
        s = self.ops.subtract(s, shift, out=s) if self.fits(s, shift) else s - shift
        return (self.ops.exp2 if base2 else self.ops.exp)(s, out=s)

    def masked(self, s: Any, allow: Any) -> Any:
        if not self.fits(s, allow):
            return super().masked(s, allow)
        return self.fill(s, self.ops.logical_not(allow), -float("inf"))

    def zeroed(self, p: Any, allow: Any) -> Any:
        # A fill, not a product with the mask: a NaN where a key is masked (a cache's
        # unwritten slots) must give 0 there, as -inf before exp does, not NaN.
        if not self.fits(p, allow):
            return super().zeroed(p, allow)
        return self.fill(p, self.ops.logical_not(allow), 0.0)

    def add(self, acc: Any, x: Any) -> Any:
        with self.quiet():  # (as in exp: inf + -inf)
            return self.ops.add(acc, x, out=acc) if self.fits(acc, x) else acc + x

    def matmul_add(self, acc: Any, a: Any, b: Any, *, slot: str | None = None) -> Any:
        # Given a slot, the first product into its buffer: a fresh [8, 128, 64] float32
        # NumPy accumulator each query block (mmap, page faults, TLB shootdowns where
        # OpenBLAS's threads spin) made [1, 8, 128, 64] take 0.84 ms against 0.47
        # (docs/benchmarks.md).
        with self.quiet():
            product = self.product(a, b, slot=slot if acc is None else "matmul_add")
        return product if acc is None else self.add(acc, product)

    def mul(self, a: Any, b: Any) -> Any:
        return self.ops.multiply(a, b, out=a) if self.fits(a, b) else a * b

    def divided(self, a: Any, b: Any) -> Any:
        return self.ops.divide(a, b, out=a) if self.fits(a, b) else a / b

    def softcap_grad(self, ds: Any, t: Any) -> Any:
        # In place into t as well: only where t is ds's shape and dtype (the block's tanh).
        if tuple(t.shape) != tuple(ds.shape) or t.dtype != ds.dtype:
            return super().softcap_grad(ds, t)
        # ds * (1 - t**2); (a scalar first in subtract: NumPy's ufuncs; torch's own step)
        t = self.ops.subtract(1.0, self.ops.multiply(t, t, out=t), out=t)
        return self.ops.multiply(ds, t, out=ds)
