"""`assert_backends_agree`: one function on every backend, the results compared."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from portable_attention.testing._convert import (
    available_backends,
    check_name,
    import_backend,
    source_framework,
    to_backend,
    to_numpy,
)
from portable_attention.testing._tolerance import tolerance

# -- nested structures -------------------------------------------------------------------------


def _is_array(x: object) -> bool:
    try:
        source_framework(x)
    except TypeError:
        return False
    return True


def _map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Apply ``fn`` to every leaf of nested tuples, lists and dicts."""
    if isinstance(tree, Mapping):
        return {key: _map(fn, value) for key, value in tree.items()}
    if isinstance(tree, tuple):
        items = [_map(fn, item) for item in tree]
        return type(tree)._make(items) if hasattr(tree, "_make") else tuple(items)
    if isinstance(tree, list):
        return [_map(fn, item) for item in tree]
    return fn(tree)


def _fresh(x: Any, name: str) -> Any:
    """``x`` as a ``name`` array that shares no memory with the caller's input."""
    out = to_backend(x, name)
    if name == "jax":  # immutable: sharing is harmless
        return out
    if name == "torch":
        return out.clone()
    if name == "array_api_strict":
        xs = import_backend(name)
        return xs.asarray(out, copy=True)
    return out.copy()  # numpy, cupy


def _leaf_to_numpy(x: Any) -> Any:
    return to_numpy(x) if _is_array(x) else x


# -- comparison --------------------------------------------------------------------------------


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"an array of shape {x.shape} and dtype {x.dtype}"
    if isinstance(x, Mapping):
        return f"a dict with keys {sorted(x, key=repr)!r}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} items"
    return f"{x!r} ({type(x).__name__})"


def _value(v: Any) -> str:
    return repr(complex(v)) if np.iscomplexobj(v) else repr(float(v))


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()


def _compare_arrays(
    ref: np.ndarray, got: np.ndarray, rtol: float | None, atol: float | None
) -> str | None:
    """None when ``got`` agrees with ``ref``; else the reason (without the location)."""
    if ref.shape != got.shape:
        return f"shape {got.shape}, the reference {ref.shape}"
    if ref.dtype != got.dtype:
        return f"dtype {got.dtype}, the reference {ref.dtype}"
    if ref.size == 0:
        return None
    kind = ref.dtype.kind
    if kind in "OSU":  # strings and objects: equal or not
        unequal = np.asarray(ref != got)
        if not unequal.any():
            return None
        first = int(np.flatnonzero(unequal)[0])
        return (
            f"{int(unequal.sum())} of {ref.size} elements differ (dtype {ref.dtype}, compared "
            f"exactly); the first at index {_index(first, ref.shape)} (got "
            f"{got.flat[first]!r}, reference {ref.flat[first]!r})"
        )
    default = tolerance(ref.dtype.name) if rtol is None or atol is None else (0.0, 0.0)
    rt = default[0] if rtol is None else float(rtol)
    at = default[1] if atol is None else float(atol)
    wide = np.complex128 if np.iscomplexobj(ref) else np.float64
    a, b = ref.astype(wide), got.astype(wide)
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        err = np.where(same, 0.0, np.abs(a - b))
        err = np.where(np.isnan(err), np.inf, err)  # NaN against a number, inf against -inf
        bound = at + rt * np.abs(a)
        # A NaN or infinite reference agrees only with its equal: its bound is not finite.
        bad = (err > bound) | (~same & ~np.isfinite(a))
        if kind in "biu" and rt == 0 and at == 0:
            bad = np.asarray(ref != got)  # exact, even where float64 would round
        if not bad.any():
            return None
        mag = np.abs(a)
        rel = np.divide(err, mag, out=np.full_like(err, np.inf), where=(mag > 0) & np.isfinite(mag))
        rel = np.where(err == 0, 0.0, rel)
        over = np.where(bad, np.where(np.isfinite(bound), err - bound, np.inf), -np.inf)
    i_abs, i_rel, i_worst = (int(np.argmax(e)) for e in (err, rel, over))
    return (
        f"{int(bad.sum())} of {a.size} elements differ beyond rtol={rt:g}, atol={at:g} "
        f"(dtype {ref.dtype}); max abs error {err.flat[i_abs]:.3g} at index "
        f"{_index(i_abs, a.shape)}, max relative error {rel.flat[i_rel]:.3g} at index "
        f"{_index(i_rel, a.shape)}; furthest beyond the tolerance at index "
        f"{_index(i_worst, a.shape)}: got {_value(b.flat[i_worst])}, "
        f"reference {_value(a.flat[i_worst])}"
    )


def _compare(
    ref: Any, got: Any, path: str, rtol: float | None, atol: float | None
) -> tuple[str, str] | None:
    """The first disagreement as ``(path, reason)``, or None."""
    if isinstance(ref, Mapping) or isinstance(got, Mapping):
        if not (isinstance(ref, Mapping) and isinstance(got, Mapping)) or set(ref) != set(got):
            return path, f"returned {_describe(got)}, the reference {_describe(ref)}"
        for key in ref:
            found = _compare(ref[key], got[key], f"{path}[{key!r}]", rtol, atol)
            if found:
                return found
        return None
    if isinstance(ref, (tuple, list)) or isinstance(got, (tuple, list)):
        if not (isinstance(ref, (tuple, list)) and isinstance(got, (tuple, list))) or len(
            ref
        ) != len(got):
            return path, f"returned {_describe(got)}, the reference {_describe(ref)}"
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            found = _compare(r, g, f"{path}[{i}]", rtol, atol)
            if found:
                return found
        return None
    if isinstance(ref, np.ndarray) or isinstance(got, np.ndarray):
        if not (isinstance(ref, np.ndarray) and isinstance(got, np.ndarray)):
            return path, f"returned {_describe(got)}, the reference {_describe(ref)}"
        reason = _compare_arrays(ref, got, rtol, atol)
        return None if reason is None else (path, reason)
    numbers = (bool, int, float, complex)
    if isinstance(ref, numbers) and isinstance(got, numbers) and type(ref) is type(got):
        reason = _compare_arrays(np.asarray(ref), np.asarray(got), rtol, atol)
        return None if reason is None else (path, reason)
    if type(ref) is not type(got) or ref != got:
        return path, f"returned {_describe(got)}, the reference {_describe(ref)}"
    return None


def _backend_names(backends: Iterable[str] | None) -> tuple[str, ...]:
    if backends is None:
        return available_backends()
    if isinstance(backends, str) or not isinstance(backends, Iterable):
        raise backends_type_error(backends)
    names = tuple(dict.fromkeys(backends))
    if not names:
        raise no_backends_error()
    for name in names:
        try:
            check_name(name)
            import_backend(name)
        except ValueError as err:
            raise unusable_backend_error(name, err) from None
    return names


def _note(err: BaseException, note: str) -> None:
    if sys.version_info >= (3, 11):
        err.add_note(note)


def assert_backends_agree(
    fn: Callable[..., Any],
    *args: Any,
    backends: Iterable[str] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run ``fn`` on each backend and assert that all give the same results.

    Every array in ``args`` and ``kwargs`` (nested in tuples, lists and dicts too) is
    converted with :func:`to_backend` to each backend in turn, as a fresh copy (``fn`` may
    not change what the next backend sees); everything else is passed as it is. Torch
    tensors arrive detached (no ``requires_grad``): take gradients inside ``fn``. The
    outputs are converted to NumPy and each backend's are compared with the first
    backend's.

    Parameters
    ----------
    fn : callable
        The function under test, called as ``fn(*args, **kwargs)`` with the converted
        arrays. It returns an array, or nested tuples/lists/dicts of arrays (and Python
        numbers, compared like 0-d arrays, or other values, compared with ``==``).
    *args
        Positional arguments of ``fn``: arrays of any framework, or anything else.
    backends : sequence of str, optional
        Names as in :func:`to_backend`; the first is the reference. Default:
        :func:`available_backends`. Inputs in a dtype a backend lacks (bfloat16 on
        array_api_strict, float64 on JAX without ``jax_enable_x64``) raise ``TypeError``:
        choose the backends then.
    rtol, atol : float, optional
        Tolerances for every output; by default :func:`tolerance` of each output's dtype
        (the package's one table, :data:`TOLERANCES`: float32 ``(1e-4, 1e-5)``, ...).
    **kwargs
        Keyword arguments of ``fn``, converted like ``args``.

    Returns
    -------
    dict
        ``{backend name: fn's outputs with every array converted to NumPy}``, in the order
        the backends ran.

    Raises
    ------
    AssertionError
        When a backend's outputs differ from the reference's in structure, shape, dtype or
        values beyond the tolerances. The message names the backend, the output (``[1]``,
        ``['lse']``, ...), the number of elements off, the max abs and max relative errors
        with their indices, and the tolerances used.
    ValueError, TypeError
        For bad ``backends`` or inputs that cannot be converted. An exception raised by
        ``fn`` propagates (on Python >= 3.11 with a note naming the backend).

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attention import attend
    >>> from portable_attention.testing import assert_backends_agree
    >>> q = np.random.default_rng(0).standard_normal((2, 4, 8), dtype=np.float32)
    >>> outs = assert_backends_agree(attend, q, q, q, causal=True, backends=["numpy"])
    >>> outs["numpy"].shape
    (2, 4, 8)
    """
    names = _backend_names(backends)
    results: dict[str, Any] = {}
    for name in names:
        try:

            def convert(x: Any, name: str = name) -> Any:
                return _fresh(x, name) if _is_array(x) else x

            b_args, b_kwargs = _map(convert, args), _map(convert, kwargs)
        except (TypeError, ValueError) as err:
            _note(err, f"(converting the inputs to backend {name!r})")
            raise
        try:
            out = fn(*b_args, **b_kwargs)
        except Exception as err:
            _note(err, f"(raised by `fn` on backend {name!r})")
            raise
        results[name] = _map(_leaf_to_numpy, out)
    ref_name = names[0]
    for name in names[1:]:
        found = _compare(results[ref_name], results[name], "", rtol, atol)
        if found is not None:
            path, reason = found
            where = f"output{path}" if path else "the output"
            msg = f"backend {name!r} disagrees with {ref_name!r} on {where}: {reason}."
            raise AssertionError(msg)
    return results


# -- argument checks and messages of this module ----------------------------------------


def backends_type_error(backends: object) -> TypeError:
    """The error for ``backends=`` that is not a sequence of names."""
    msg = (
        f"`backends` must be a sequence of backend names like ('numpy', 'torch'), got {backends!r}."
    )
    return TypeError(msg)


def no_backends_error() -> ValueError:
    """The error for an empty ``backends=``."""
    msg = "`backends` is empty: name at least one backend, e.g. ('numpy', 'torch')."
    return ValueError(msg)


def unusable_backend_error(name: str, err: BaseException) -> ValueError:
    """The error for a name in ``backends=`` that is unknown or does not import."""
    msg = f"`backends` has {name!r}: {err}"
    return ValueError(msg)
