"""The consistency report's rows for array libraries whose calls build a graph instead of
computing: dask (the row computes the call's graph on the threaded scheduler, the inputs
chunked along the batch) and ndonnx (the row builds an ONNX model of the call, with a
symbolic batch and lengths where the call allows it, and runs it in onnxruntime).

Their rows are asked for by name (``--backends dask,ndonnx``): the default report runs
the eager frameworks. A row's time is one run of what the library defers: dask's graph
built and computed, the ONNX model run by onnxruntime (it is built once, like a compiled
program).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from portable_attention import plan
from portable_attention._cases import Array, Case

#: The libraries these rows serve (names of the report's ``--backends``).
LAZY = ("dask", "ndonnx")

#: ``run() -> results``: one run of a row's call, its results as NumPy arrays.
Run = Callable[[], list[Array]]


def _results(result: Any) -> list[Any]:
    return list(result) if isinstance(result, tuple) else [result]


def lazy_row(
    backend: str, call: Callable[..., Any], case: Case, arrays: dict[str, Array], dtype: str
) -> tuple[str, Run, str]:
    """``(path, run, kind error)`` of ``case`` on ``backend`` (one of :data:`LAZY`),
    ``arrays`` rounded to ``dtype``, ``call`` the target's ``attend``. The kind error
    (empty where none) says where the call's results are not the library's arrays of
    ``dtype``."""
    if backend == "dask":
        return _dask_row(call, case, arrays, dtype)
    return _ndonnx_row(call, case, arrays, dtype)


def _kind(results: list[Any], array_type: Any, dtype: str) -> str:
    from portable_attention.testing._convert import dtype_name

    for x in results:
        if not isinstance(x, array_type) or dtype_name(x.dtype) != dtype:
            return f"returned a {type(x).__name__} of {x.dtype} for {dtype} inputs"
    return ""


def _dask_row(
    call: Callable[..., Any], case: Case, arrays: dict[str, Array], dtype: str
) -> tuple[str, Run, str]:
    import dask
    import dask.array as da

    lazy = {
        n: da.from_array(a, chunks=(1, *a.shape[1:]) if n in "qkv" and a.ndim > 2 else a.shape)
        for n, a in arrays.items()
    }
    q, k, v = lazy.pop("q"), lazy.pop("k"), lazy.pop("v")
    path = plan(q, k, v, **lazy, **case.options).path
    error = _kind(_results(call(q, k, v, **lazy, **case.options)), da.Array, dtype)

    def run() -> list[Array]:
        results = _results(call(q, k, v, **lazy, **case.options))
        return [np.asarray(x) for x in dask.compute(*results, scheduler="threads")]

    return path, run, error


def _ndonnx_row(
    call: Callable[..., Any], case: Case, arrays: dict[str, Array], dtype: str
) -> tuple[str, Run, str]:
    import ndonnx as ndx
    import onnxruntime as ort

    static = "chunk_size" in case.options  # blocks need static lengths

    def dims(name: str, shape: tuple[int, ...]) -> tuple[int | str, ...]:
        """Symbolic batch ``B`` and lengths ``Lq``, ``Lk`` where ``shape`` has them."""
        out: list[int | str] = list(shape)
        for axis, n in enumerate(shape):
            back = len(shape) - axis
            if static or n == 1:
                continue
            if back == 4:
                out[axis] = "B"
            elif back == 2:
                out[axis] = "Lk" if name in ("k", "v") else "Lq"
            elif back == 1 and name in ("mask", "bias"):
                out[axis] = "Lk"
        return tuple(out)

    symbols = {
        n: ndx.argument(shape=dims(n, a.shape), dtype=getattr(ndx, a.dtype.name))
        for n, a in arrays.items()
    }
    given = {n: x for n, x in symbols.items() if n not in "qkv"}
    path = plan(symbols["q"], symbols["k"], symbols["v"], **given, **case.options).path
    results = _results(call(symbols["q"], symbols["k"], symbols["v"], **given, **case.options))
    error = _kind(results, ndx.Array, dtype)
    model = ndx.build(symbols, {f"result{i}": x for i, x in enumerate(results)})
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def run() -> list[Array]:
        return list(session.run(None, arrays))

    return path, run, error
