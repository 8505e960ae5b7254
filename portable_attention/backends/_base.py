"""The adapter protocol: what a framework's module offers the planner and the core.

An :class:`Adapter` binds what the array API standard cannot express for one framework:

- ``keep_mask(rng, p, xp, device)``: the dropout keep-mask drawer from the framework's
  RNG (``shape -> bool array``); a wrong ``rng`` raises here, named.
- ``scores(q, k)``: ``q @ k^T`` where the framework has a faster formulation than
  ``matmul(q, matrix_transpose(k))``; :mod:`portable_attention._core` takes it as an
  argument.
- ``fused``: the framework's fused kernel (``implementation="fused"`` asks for it), or
  None; ``fused_kernels``: all of them, in the order the planner asks them (torch: SDPA,
  then FlexAttention).
- ``tuned``: a kernel of the package's own written for this framework (NumPy's blocked
  kernel, JAX's query blocks under ``lax.map``, dask's per-chunk calls), which only
  ``auto`` takes, or None; its path is ``tuned:<framework>`` (``per-chunk:dask``).
- ``block_keep(rng, p, xp, device)``: dropout's keep masks for the blockwise path, one
  per block, each a deterministic function of ``rng`` and the block's number
  (:data:`~portable_attention._blockwise.BlockKeep`), so that the backward draws the
  forward's masks again instead of storing them.
- ``autodiff``: whether the framework differentiates through ``attend`` (torch, JAX); the
  planner then keeps the dense path only while what it would save for backward is small.
- ``blockwise(call, ...)``: the blockwise path's forward, differentiable with the
  blockwise backward through the framework's custom-gradient mechanism (torch: an
  ``autograd.Function``; JAX: a ``custom_vjp`` over compiled loops); by default the
  array-API forward of :mod:`portable_attention._blockwise` (no autodiff to hook).
- ``blockwise_backward(call, ...)``: that backward (``attend_backward``); by default the
  array-API one.
- ``block_loop(call)``: how the blockwise path walks its blocks
  (:class:`~portable_attention._block_loop.BlockLoop`): Python loops over static
  offsets by default (NumPy's with a span budget, ``span_scores``); JAX's compiled loops.
- ``block_math(xp, arrays)``: the elementwise steps of the blockwise path's inner loops
  (:class:`~portable_attention._block_math.BlockMath`); a framework that can update a
  block in place (where autodiff does not record) returns a subclass that does (an
  :class:`~portable_attention._block_math.OutMath` where its functions take ``out=``:
  NumPy's, torch's).

Both kernels are :class:`Kernel` objects. The planner asks ``reason(call)`` (why the
kernel cannot run the call; None: it can) and, for ``auto`` only, ``auto_reason(call)``
(why ``auto`` prefers the portable path although the kernel could run). Decisions may
read any field of the :class:`~portable_attention._spec.Call`: plans are memoised with
the whole call description, so nothing has to be listed for a cache key.

A new backend is one module in this package that defines ``ADAPTER``, an instance of a
subclass of :class:`Adapter`, registered by name in :mod:`portable_attention.backends`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import array_api_compat
import numpy as np

from portable_attention import _blockwise, _blockwise_backward
from portable_attention._block_loop import BlockLoop
from portable_attention._block_math import BlockMath
from portable_attention._blockwise import BlockKeep, Grads
from portable_attention._core import KeepMask
from portable_attention._mods import Mods
from portable_attention._spec import Call

#: ``kernel(q, k, v) -> out``: a fused kernel with every other argument bound.
Prepared = Callable[[Any, Any, Any], Any]

#: The call memo's key getters of one framework: ``(of one array, of q, k and v at
#: once)``, each returning a hashable tuple, or None where the array has no key.
MemoKeys = tuple[Callable[[Any], Any], Callable[[Any, Any, Any], Any]]


class Kernel(ABC):
    """A kernel besides the portable path, with the reasons the planner reports."""

    #: The plan's path while this kernel runs (``"fused:torch"``, ``"tuned:jax"``).
    path: ClassVar[str]
    #: The plan's reason while this kernel runs, in words.
    why: ClassVar[str]

    @abstractmethod
    def reason(self, call: Call) -> str | None:
        """Why this kernel cannot give the contract's answer for ``call`` (None: it can)."""

    def auto_reason(self, call: Call) -> str | None:
        """Why ``auto`` takes the portable path although this kernel could run (None:
        it takes this kernel)."""
        return None

    def taken(self, call: Call) -> str:
        """The plan's reason where this kernel runs ``call`` (by default :attr:`why`)."""
        return self.why

    def hands_over(self, call: Call, q: Any, k: Any, v: Any) -> str | None:
        """Why this kernel, planned for ``call``, gives these arrays to the blockwise path
        when it runs (what the shapes cannot tell: autograd's state); None: it runs them.
        ``plan()`` reports it."""
        return None

    @abstractmethod
    def run(
        self,
        call: Call,
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        bias: Any,
        keep: KeepMask | None,
        mods: Mods | None = None,
    ) -> tuple[Any, Any, Any]:
        """``(out, weights or None, lse or None)`` for a call :meth:`reason` accepted
        (``lse`` at least where ``call.return_lse`` or sinks ask for it).

        A fused kernel draws its own dropout and is given ``keep=None``; ``mods`` holds
        the segment ids and mods of a call that has them (fused kernels decline those)."""

    def prepare(self, call: Call) -> Prepared | None:
        """A function of ``(q, k, v)`` alone for ``call``, where the kernel can bind
        everything else (one Python call less on a repeated call); None: use :meth:`run`."""
        return None


class Adapter(ABC):
    """One framework's bindings; see the module docstring."""

    #: The framework's name in messages ("torch", "JAX").
    name: ClassVar[str]
    #: What ``rng=`` takes on this framework, in words (in messages).
    rng: ClassVar[str]

    @property
    def fused(self) -> Kernel | None:
        """The framework's fused kernel, or None (a subclass may import it when first
        read, as torch's and JAX's adapters do, or set a class attribute)."""
        return None

    @property
    def fused_kernels(self) -> tuple[Kernel, ...]:
        """The fused kernels in the order the planner asks them (the first that can run
        a call, and that ``auto`` does not decline, runs it): by default :attr:`fused`
        alone."""
        fused = self.fused
        return () if fused is None else (fused,)

    @property
    def tuned(self) -> Kernel | None:
        """The package's own kernel for this framework, or None (as :attr:`fused`)."""
        return None

    #: Whether this framework's autodiff differentiates through ``attend``: its dense
    #: path would save the probabilities ``[..., Lq, Lk]`` for backward.
    autodiff: ClassVar[bool] = False

    @abstractmethod
    def keep_mask(self, rng: Any, p: float, xp: Any, device: Any) -> KeepMask:
        """The keep-mask drawer of ``rng`` (checked here, even where it goes unused)."""

    @abstractmethod
    def block_keep(self, rng: Any, p: float, xp: Any, device: Any) -> BlockKeep:
        """The blockwise path's keep masks from ``rng``: one per block number, the same
        mask each time a block is asked for. A stateful generator is read once, here (it
        advances, so the next call draws other masks); a generator in the same state (one
        made again from the same seed, or the same JAX key) gives the same masks."""

    def blockwise(
        self,
        call: Call,
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        bias: Any,
        keep: BlockKeep | None,
        mods: Mods | None = None,
    ) -> tuple[Any, Any]:
        """``(out, lse)`` of the blockwise path, differentiable by this framework's
        autodiff with :meth:`blockwise_backward` as the gradient (where it has one).
        ``mods``: the call's segment ids and mods (sinks are merged in by the caller)."""
        return _blockwise.forward(call, q, k, v, mask, bias, keep, mods=mods)

    def blockwise_backward(
        self,
        call: Call,
        dout: Any,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        mask: Any,
        bias: Any,
        keep: BlockKeep | None,
        dlse: Any,
        mods: Mods | None = None,
        sinks: Any = None,
    ) -> Grads:
        """The blockwise backward (FlashAttention-2's) of the call, from ``out`` and
        ``lse``; ``keep`` replays :meth:`blockwise`'s dropout; ``sinks`` (with the ``lse``
        that includes them) adds ``dsinks``."""
        return _blockwise_backward.backward(
            call, dout, q, k, v, out, lse, mask, bias, keep, dlse=dlse, mods=mods, sinks=sinks
        )

    def unshifted_exp(self, call: Call) -> bool:
        """Whether the blockwise forward of ``call`` first tries ``exp(s)`` without the
        running max, checking each query block's row sums after (one host read per query
        block): two passes over every block of scores fewer where it holds, all of them
        again where it does not. Worth it where passes over memory dominate and a host
        read costs nothing (NumPy; torch on the CPU); by default not."""
        return False

    def block_math(self, xp: Any, arrays: tuple[Any, ...]) -> BlockMath:
        """The blockwise path's elementwise steps for a call on ``arrays`` (its inputs;
        None where absent): by default the functional ones of the array API."""
        return BlockMath(xp)

    def blockwise_reason(self, call: Call) -> str | None:
        """Why ``auto`` takes the blockwise path for a call that no kernel takes, at sizes
        where the size rules of :func:`~portable_attention._plan.portable_plan` would give
        the dense path (the framework runs it faster there); None where those rules
        decide."""
        return None

    def block_loop(self, call: Call) -> BlockLoop:
        """How the blockwise path walks its blocks
        (:class:`~portable_attention._block_loop.BlockLoop`): by default Python loops over
        static offsets."""
        return BlockLoop(call.xp, call.device)

    def host_bool(self, x: Any) -> bool | None:
        """A 0-d boolean array as a Python bool (a host read), or None where it cannot be
        read now (a compiler traces): the blockwise path then skips the blocks that
        segment ids or a ``mask_mod`` mask entirely."""
        return bool(x)

    def to_host(self, x: Any) -> Any:
        """A small boolean (or standard-dtype) array's values as a NumPy array (a host
        read, copied from a device): what a block plan reads of a ``mask_mod``'s result."""
        try:
            return np.from_dlpack(x)
        except (AttributeError, BufferError, RuntimeError, TypeError, ValueError):
            return np.asarray(x)  # (no __dlpack__: dask; a device array: JAX on a GPU)

    def scores(self, xp: Any) -> Callable[[Any, Any], Any] | None:
        """``q @ k^T`` for ``xp``'s arrays where this framework has a faster formulation;
        None: ``matmul(q, matrix_transpose(k))``."""
        return None

    def tracing(self) -> bool:
        """Whether a compiler is tracing this call now (``torch.compile``): the planner
        then skips its ``lru_cache``, which the tracer would ignore with a warning."""
        return False

    # -- what the contract and the memo ask of this framework's arrays ----------------------

    def check_array(self, name: str, x: Any) -> None:  # noqa: B027 (a hook: no refusal)
        """Refuse, with a TypeError that says what to pass, an array of this framework that
        ``attend`` cannot take as it is (NumPy's scalars and masked arrays, torch's nested
        and sparse tensors); run on every array of every validated call."""

    def scalar_refusal(self, name: str, x: Any) -> str | None:
        """Why an array of this framework given for the number option ``name`` (``scale``,
        ``softcap``, ``dropout``) cannot be read as one (torch: a tensor that requires grad,
        whose gradient would be lost); None: its value is read."""
        return None

    #: What to do instead when a number option's array cannot be read on the host (a
    #: traced or many-element array): appended to the TypeError.
    static_hint: ClassVar[str] = ""

    def device(self, x: Any) -> Any:
        """The device of array ``x``."""
        return array_api_compat.device(x)

    def placement(self, device: Any) -> Any:
        """Where an array on ``device`` (as :meth:`device` gives it) lives, for comparing
        arrays' devices; not ``device`` itself where the array spans several devices (the
        call then leaves placing what it makes to the framework). By default ``device``."""
        return device

    def caches_type(self, x: Any) -> bool:
        """Whether what ``x``'s type says (namespace, framework, this adapter) may be
        cached by type; not for JAX's float0 gradients, which are NumPy arrays."""
        return True

    def memo_keys(self) -> MemoKeys | None:
        """The call memo's key getters of this framework's arrays, faster than the generic
        ``(shape, dtype, device)`` (see :mod:`portable_attention._memo`); None: those."""
        return None

    def traced(self, x: Any) -> bool:
        """Whether ``x``'s values cannot be read on the host now (a JAX tracer, a tensor
        while ``torch.compile`` traces)."""
        return self.tracing()
