"""Gradients of an attention function through its framework's own autodiff.

:func:`~portable_attention.testing.check_attention`'s gradient cases call the function
under test through :func:`vjp`: ``torch.autograd.grad`` for torch tensors, ``jax.vjp``
for JAX arrays. Frameworks without autodiff (NumPy, CuPy, array_api_strict) are not
differentiable here: :func:`differentiable` says so and those cases are skipped.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from portable_attention.testing._convert import to_backend, to_numpy

#: The frameworks whose autodiff :func:`vjp` uses.
DIFFERENTIABLE = ("torch", "jax")


def differentiable(backend: str) -> bool:
    """Whether :func:`vjp` can differentiate a function of ``backend`` arrays."""
    return backend in DIFFERENTIABLE


def vjp(
    call: Callable[..., Any],
    primals: Mapping[str, Any],
    cotangent: np.ndarray,
    backend: str,
    device: Any = None,
) -> dict[str, np.ndarray]:
    """The vector-Jacobian product of ``call(**primals)`` with ``cotangent``.

    Parameters
    ----------
    call : callable
        Takes the arrays of ``primals`` by keyword and returns one array (the output).
    primals : mapping of str to array
        The ``backend`` arrays to differentiate with respect to.
    cotangent : numpy.ndarray
        The output's cotangent, converted to ``backend`` in the output's dtype.
    backend : {"torch", "jax"}
    device : optional
        Where the cotangent goes (as :func:`to_backend` takes it).

    Returns
    -------
    dict of str to numpy.ndarray
        The gradient with respect to each primal, float64 NumPy (zeros for a primal the
        output does not depend on).
    """
    names = list(primals)
    if backend == "torch":
        torch = sys.modules["torch"]
        leaves = {n: primals[n].detach().clone().requires_grad_(True) for n in names}
        out = call(**leaves)
        ct = to_backend(cotangent, "torch", device).to(out.dtype)
        grads = torch.autograd.grad(out, [leaves[n] for n in names], ct, allow_unused=True)
        return {
            n: np.zeros(tuple(primals[n].shape)) if g is None else to_numpy(g, dtype="float64")
            for n, g in zip(names, grads, strict=True)
        }
    if backend == "jax":
        jax = sys.modules["jax"]
        out, pullback = jax.vjp(
            lambda *xs: call(**dict(zip(names, xs, strict=True))), *(primals[n] for n in names)
        )
        ct = to_backend(cotangent, "jax", device).astype(out.dtype)
        ct = jax.device_put(ct, out.sharding)  # where the output is (a mesh, say)
        grads = pullback(ct)
        return {n: to_numpy(g, dtype="float64") for n, g in zip(names, grads, strict=True)}
    msg = f"`backend`={backend!r} has no autodiff here; differentiable: {DIFFERENTIABLE}."
    raise ValueError(msg)
