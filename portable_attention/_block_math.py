"""The elementwise steps of the blockwise path's inner loops (and of the dense path, its
one-block case), as one small interface.

:mod:`portable_attention._blockwise` computes every block's scores, probabilities and
gradients through a :class:`BlockMath`. This class is the array-API default: every step
returns a new array. An adapter whose framework can update an array in place passes a
subclass that does (``Adapter.block_math``): on a ``[8, 256, 256]`` float32 block, torch's
``a * b`` took 131 us against 48 us for ``a.mul_(b)`` on this project's 2-core machine (a
pass over memory and a fresh buffer less), and both passes of the blockwise path make
several such steps per block.

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

from typing import Any


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
