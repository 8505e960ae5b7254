"""``python -m portable_attention``: the cross-framework consistency report.

Runs the fixed battery of :mod:`portable_attention._cases` through
:func:`portable_attention.attend` on every installed backend (NumPy, array_api_strict,
PyTorch, JAX, CuPy), on every device it sees (the CPU; CUDA where torch, JAX or CuPy see
a GPU), in float32 and in the half dtypes the backend has, and compares every result

* to a float64 oracle (:func:`portable_attention.testing.reference_attention`, the dense
  formula in float64 NumPy written apart from the package's kernels, on the same rounded
  inputs), and
* to every other backend and device's result for the same case and dtype,

elementwise, ``|x - ref| <= atol + rtol * |ref|`` with the tolerances of the package's
one table (:func:`portable_attention.testing.tolerance`; :data:`TOLERANCES` here). It
prints one row per call: the path ``plan()`` names, the largest absolute and (normwise)
relative error against the oracle, the largest difference from
another backend, the verdict and the time of one call. Exit status 0 when everything
agrees, 1 when anything disagrees (or raises), 2 for bad command-line arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from portable_attention import _cases, attend, plan
from portable_attention._cases import Array, Case
from portable_attention._report_lazy import LAZY, lazy_row
from portable_attention.testing import tolerance
from portable_attention.testing._convert import dtype_name, source_framework, to_backend, to_numpy

#: The report's dtypes and their (rtol, atol) for out and weights, from the package's one
#: table (:func:`portable_attention.testing.tolerance`): a result agrees where
#: ``|x - ref| <= atol + rtol * |ref|``.
TOLERANCES: dict[str, tuple[float, float]] = {
    name: tolerance(name, "out") for name in ("float32", "float16", "bfloat16")
}

#: Backends the report knows, in report order, and the dtypes it runs on each.
#: NumPy has float16 (``attend`` computes it in float32) but no bfloat16;
#: array_api_strict has neither (the standard has no half dtypes); CuPy has float16.
DTYPES: dict[str, tuple[str, ...]] = {
    "numpy": ("float32", "float16"),
    "array_api_strict": ("float32",),
    "torch": ("float32", "float16", "bfloat16"),
    "jax": ("float32", "float16", "bfloat16"),
    "cupy": ("float32", "float16"),
    "dask": ("float32", "float16"),  # run where named in --backends (_report_lazy.py)
    "ndonnx": ("float32",),
}
DEVICES = ("cpu", "cuda")

#: The case whose weights ``--plot`` draws unless ``--plot-case`` names another.
PLOT_CASE = "window"


@dataclass(frozen=True)
class Target:
    """One backend on one device: where the battery runs.

    Attributes
    ----------
    backend : str
        A name :func:`portable_attention.testing._convert.to_backend` knows (``"numpy"``,
        ``"torch"``, ...); the inputs are converted to it.
    device : str
        ``"cpu"`` or ``"cuda"``.
    dtypes : tuple of str
        The dtypes to run, names from :data:`TOLERANCES`.
    label : str
        The name in the report's backend column (default: ``backend``).
    call : callable
        Called as ``attend`` is, on the converted arrays (default :func:`attend`).
        A test passes a wrapper here to check that a wrong result is caught.
    """

    backend: str
    device: str
    dtypes: tuple[str, ...]
    label: str = ""
    call: Callable[..., Any] = attend

    @property
    def name(self) -> str:
        return self.label or self.backend


@dataclass(eq=False)
class Row:
    """The result of one call: one line of the table, one object of ``--json``."""

    case: str
    backend: str
    device: str
    dtype: str
    path: str = "-"
    max_abs: float | None = None  # None: not computed (the call failed)
    max_rel: float | None = None
    vs_others: float | None = None  # None: no other backend ran this case and dtype
    verdict: str = "agree"
    ms: float | None = None
    error: str = ""
    result: list[Array] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return self.verdict == "agree"

    def as_dict(self) -> dict[str, Any]:
        names = ("case", "backend", "device", "dtype", "path", "max_abs", "max_rel")
        data: dict[str, Any] = {n: getattr(self, n) for n in names}
        data.update(
            vs_others=self.vs_others, verdict=self.verdict, ok=self.ok, ms=self.ms, error=self.error
        )
        # JSON has no NaN/inf: they become strings ("nan", "inf"); null: not computed.
        return {
            n: (str(x) if isinstance(x, float) and not math.isfinite(x) else x)
            for n, x in data.items()
        }


# -- backends and devices -----------------------------------------------------------------------


def installed() -> list[str]:
    """The backends of :data:`DTYPES` whose framework is installed, in report order."""
    return [n for n in DTYPES if n not in LAZY and importlib.util.find_spec(n) is not None]


def _sees_cuda(backend: str) -> bool:
    """Whether ``backend`` (installed) sees a CUDA GPU. Imports the framework."""
    try:
        if backend == "torch":
            import torch

            return bool(torch.cuda.is_available())
        if backend == "jax":
            import jax

            return any(d.platform == "gpu" for d in jax.devices())
        if backend == "cupy":
            import cupy

            return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # a broken driver or runtime: this backend sees no GPU
        return False
    return False


def targets(
    backends: Sequence[str], devices: Sequence[str], dtypes: Sequence[str] = tuple(TOLERANCES)
) -> list[Target]:
    """The targets for ``backends`` on ``devices`` (those it has; CuPy is CUDA only).

    Each runs the ``dtypes`` it has (:data:`DTYPES`); a backend with none of them is left out.
    """
    if "cuda" not in devices and "jax" in backends and "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no GPU probing (and warning) wanted
    found = []
    for backend in backends:
        for device in devices:
            if device == "cpu" and backend == "cupy":
                continue
            if device == "cuda" and not _sees_cuda(backend):
                continue
            has = tuple(d for d in DTYPES[backend] if d in dtypes and _can_run(d))
            if has:
                found.append(Target(backend, device, has))
    return found


def _can_run(dtype: str) -> bool:
    """bfloat16 needs ml_dtypes (to round the inputs); the other dtypes run anywhere."""
    return dtype != "bfloat16" or _cases.has_bfloat16()


# -- running --------------------------------------------------------------------------------------


def _to_target(a: Array, target: Target, dtype: str) -> Any:
    """NumPy data (already rounded to ``dtype``) as ``target``'s array of that dtype."""
    x = to_backend(np.ascontiguousarray(a), target.backend, device=target.device)
    if a.dtype == np.bool_ or (dtype == a.dtype.name):
        return x
    import array_api_compat

    xp = array_api_compat.array_namespace(x)
    return xp.astype(x, getattr(xp, dtype))  # bfloat16 from float32 holding bfloat16 values


def _sync(result: Sequence[Any]) -> None:
    """Wait for asynchronous work (JAX dispatch, CUDA streams) behind ``result``."""
    for x in result:
        if hasattr(x, "block_until_ready"):
            x.block_until_ready()
        elif type(x).__module__.startswith("torch") and x.is_cuda:
            import torch

            torch.cuda.synchronize(x.device)
        elif type(x).__module__.startswith("cupy"):
            x.device.synchronize()


def _as_list(result: Any) -> list[Any]:
    return list(result) if isinstance(result, tuple) else [result]


def run_one(case: Case, target: Target, dtype: str, *, repeats: int = 3) -> Row:
    """Run ``case`` on ``target`` in ``dtype``: the row without the comparisons."""
    row = Row(case.name, target.name, target.device, dtype)
    try:
        rounded = {n: _cases.rounded(a, dtype) for n, a in case.arrays.items()}
        if target.backend in LAZY:  # dask computes, ndonnx's ONNX model runs: in call()
            row.path, call, row.error = lazy_row(target.backend, target.call, case, rounded, dtype)
        else:
            arrays = {n: _to_target(a, target, dtype) for n, a in rounded.items()}
            q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
            row.path = plan(q, k, v, **arrays, **case.options).path

            def eager() -> list[Any]:
                return _as_list(target.call(q, k, v, **arrays, **case.options))

            call = eager
        result = call()  # warm-up (JAX compiles)
        _sync(result)
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            _sync(call())
            best = min(best, time.perf_counter() - start)
        row.ms = best * 1e3
        if target.backend not in LAZY:
            row.error = _kind_mismatch(result, q, dtype)
        if row.error:
            row.verdict = "DISAGREE"
        row.result = [to_numpy(x, dtype="float64") for x in result]
    except Exception as exc:  # the report goes on; the row says what went wrong
        row.verdict, row.error = "ERROR", f"{type(exc).__name__}: {exc}"
    return row


def _kind_mismatch(result: Sequence[Any], q: Any, dtype: str) -> str:
    """Why ``result`` is not arrays of ``q``'s framework and device in ``dtype`` ("" if it is)."""
    import array_api_compat

    framework, device = source_framework(q), array_api_compat.device(q)
    for x in result:
        got = (source_framework(x), dtype_name(x.dtype))
        if got != (framework, dtype):
            return f"returned a {got[0]} {got[1]} array for {framework} {dtype} inputs"
        if array_api_compat.device(x) != device:
            return f"returned an array on {array_api_compat.device(x)} for inputs on {device}"
    return ""


def _within(x: Array, y: Array, ref: Array, dtype: str, what: str) -> bool:
    rtol, atol = tolerance(dtype, what)
    return x.shape == y.shape and bool(np.all(np.abs(x - y) <= atol + rtol * np.abs(ref)))


#: What the results of a row are: out, and the weights where the case returns them.
_OUTPUTS = ("out", "weights")


def _worst(a: float | None, b: float) -> float:
    """The larger error; NaN wins (a NaN result must not hide behind a smaller number)."""
    if a is None:
        return b
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _max_abs(x: Array, y: Array) -> float:
    if x.shape != y.shape:
        return math.inf
    return float(np.max(np.abs(x - y))) if x.size else 0.0


def compare(rows: Sequence[Row], references: Mapping[tuple[str, str], list[Array]]) -> None:
    """Fill in every row's errors and verdict, against the oracle and against each other.

    ``references[(case, dtype)]`` is the oracle's ``[out]`` (``[out, weights]`` for cases
    that return the weights). Rows of the same case and dtype are compared pairwise.
    """
    for row in rows:
        if row.verdict == "ERROR":
            continue
        ref = references[(row.case, row.dtype)]
        if len(row.result) != len(ref):
            row.verdict, row.error = "DISAGREE", f"{len(row.result)} results, expected {len(ref)}"
            continue
        worst = max_abs = math.nan if not ref else 0.0
        for x, r in zip(row.result, ref, strict=True):
            max_abs = _max_abs(x, r)
            worst = _worst(worst, max_abs)
        scale = max(float(np.max(np.abs(r))) if r.size else 0.0 for r in ref)
        row.max_abs, row.max_rel = worst, (worst / scale if scale > 0 else worst)
        checks = zip(row.result, ref, _OUTPUTS[: len(ref)], strict=True)
        if not all(_within(x, r, r, row.dtype, what) for x, r, what in checks):
            row.verdict = "DISAGREE"
    # Pairwise: results that each agree with the oracle must agree with each other too.
    # (A row already off the oracle is reported as such, and does not blame the others.)
    near_oracle = {id(row) for row in rows if row.ok}
    for row in rows:
        if row.verdict == "ERROR":
            continue
        ref = references[(row.case, row.dtype)]
        for other in rows:
            if other is row or other.verdict == "ERROR":
                continue
            if (other.case, other.dtype) != (row.case, row.dtype):
                continue
            pairs = list(zip(row.result, other.result, ref, _OUTPUTS, strict=False))
            for x, y, _, _ in pairs:
                row.vs_others = _worst(row.vs_others, _max_abs(x, y))
            if (
                row.ok
                and id(other) in near_oracle
                and not all(_within(x, y, r, row.dtype, what) for x, y, r, what in pairs)
            ):
                row.verdict = f"DISAGREE vs {other.backend}/{other.device}"


Progress = Callable[[int, int, str], None]


def run(
    cases: Sequence[Case], run_on: Sequence[Target], *, progress: Progress | None = None
) -> list[Row]:
    """Every case on every target in each of its dtypes, compared.

    Runs target by target (one dtype at a time, so JAX compiles each shape once); returns
    the rows ordered by case, then dtype, then target, as the table prints them.
    """
    jobs = [(t, d, c) for t in run_on for d in t.dtypes for c in cases]
    rows = []
    for i, (target, dtype, case) in enumerate(jobs, 1):
        if progress is not None:
            progress(i, len(jobs), f"{target.name} {target.device} {dtype} {case.name}")
        rows.append(run_one(case, target, dtype))
    references: dict[tuple[str, str], list[Array]] = {}
    for row in rows:
        key = (row.case, row.dtype)
        if key not in references:
            case = next(c for c in cases if c.name == row.case)
            out, weights = _cases.oracle(case, row.dtype)
            references[key] = [out, weights] if case.returns_weights else [out]
    compare(rows, references)
    case_order = {c.name: i for i, c in enumerate(cases)}
    dtype_order = {d: i for i, d in enumerate(TOLERANCES)}
    # The table reads one case at a time: its dtypes, each on every backend and device.
    return sorted(rows, key=lambda r: (case_order[r.case], dtype_order.get(r.dtype, 99)))


# -- output ---------------------------------------------------------------------------------------

COLUMNS: tuple[str, ...] = ("case", "backend", "device", "dtype", "path", "max abs err")
COLUMNS += ("max rel err", "vs others", "verdict", "ms")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table with a header line (:data:`COLUMNS`)."""
    cells = [COLUMNS] + [
        (
            r.case,
            r.backend,
            r.device,
            r.dtype,
            r.path,
            _num(r.max_abs),
            _num(r.max_rel),
            _num(r.vs_others),
            r.verdict,
            "-" if r.ms is None else f"{r.ms:.2f}",
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    right = {5, 6, 7, 9}  # numbers align right
    lines = [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _version(name: str) -> str:
    version = getattr(sys.modules.get(name), "__version__", None)
    if isinstance(version, str):
        return version
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version(name.replace("_", "-"))
    except PackageNotFoundError:
        return "(version unknown)"


def _header(cases: Sequence[Case], run_on: Sequence[Target]) -> str:
    from portable_attention import __version__

    versions = [f"{name} {_version(name)}" for name in dict.fromkeys(t.backend for t in run_on)]
    tol = ", ".join(f"{d} rtol={r:g} atol={a:g}" for d, (r, a) in TOLERANCES.items())
    lines = [
        f"portable_attention {__version__}: the same attention on every backend, device and dtype",
        f"backends: {', '.join(versions)}",
        f"devices: {', '.join(dict.fromkeys(t.device for t in run_on))}",
        "oracle: portable_attention.testing.reference_attention (the dense formula in float64 "
        "NumPy, apart from the package's kernels), on the same rounded inputs",
        f"agree when |x - ref| <= atol + rtol * |ref| everywhere: {tol}",
        "max rel err = max|x - oracle| / max|oracle|; vs others = max|x - y| over the other "
        "backends' results (same case and dtype, checked with the same tolerance)",
        "ms: fastest of 3 calls after a warm-up call",
        "cases:",
    ]
    lines += [f"  {c.name:<12} {c.about}" for c in cases]
    return "\n".join(lines)


def _progress_printer(stream: TextIO) -> tuple[Progress, Callable[[], None]]:
    tty = stream.isatty()
    width = [0]

    def show(i: int, n: int, what: str) -> None:
        text = f"[{i}/{n}] {what}"
        if tty:
            stream.write("\r" + text.ljust(width[0]))
            width[0] = max(width[0], len(text))
        else:
            stream.write(text + "\n")
        stream.flush()

    def done() -> None:
        if tty and width[0]:
            stream.write("\r" + " " * width[0] + "\r")
            stream.flush()

    return show, done


def plot_weights(
    case: Case, run_on: Sequence[Target], path: str, *, dtype: str = "float32"
) -> list[str]:
    """Save a heatmap of ``case``'s weights (batch 0, head 0), one panel per target.

    Returns the panel titles. Targets where the call fails get no panel; with no panel at
    all nothing is written.
    """
    from portable_attention import plot

    weights: dict[str, Any] = {}
    for target in (t for t in run_on if t.backend not in LAZY):  # eager weights only
        arrays = {
            n: _to_target(_cases.rounded(a, dtype), target, dtype) for n, a in case.arrays.items()
        }
        q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
        options = {
            n: x for n, x in case.options.items() if n not in ("chunk_size", "return_weights")
        }
        try:
            _, w = target.call(q, k, v, **arrays, **options, return_weights=True)
        except Exception as exc:  # the table already has this call's error
            print(f"--plot: no panel for {target.name} {target.device}: {exc}", file=sys.stderr)
            continue
        weights[f"{target.name} {target.device}"] = w
    if not weights:
        return []
    figure = plot.side_by_side(weights, head=(0, 0), title=f"{case.name} ({dtype}): {case.about}")
    figure.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return list(weights)


# -- command line ---------------------------------------------------------------------------------


def _package_version() -> str:
    from portable_attention import __version__

    return __version__


def parser() -> argparse.ArgumentParser:
    """The report's command-line options (also the help of ``python -m portable_attention``)."""
    p = argparse.ArgumentParser(
        prog="python -m portable_attention",
        description=(
            "Run a fixed battery of attention cases through portable_attention.attend on every "
            "installed backend (numpy, array_api_strict, torch, jax, cupy), device and dtype; "
            "compare each result to a float64 oracle and to the other backends; print a table. "
            "Exit status 1 on a disagreement beyond the tolerance, 2 on bad arguments."
        ),
        epilog=(
            "other commands: 'python -m portable_attention demo' prints a small worked "
            "example; 'python -m portable_attention bench --help' times attend against "
            "each framework's own attention."
        ),
    )
    p.add_argument(
        "--backends",
        metavar="LIST",
        help=f"comma list of backends to run, of {', '.join(DTYPES)} (default: every installed "
        "one but dask and ndonnx, whose rows compute a dask graph and run an ONNX model)",
    )
    p.add_argument(
        "--devices",
        metavar="LIST",
        default=None,
        help="comma list of cpu, cuda (default: cpu, and cuda where a backend sees a GPU)",
    )
    p.add_argument(
        "--dtypes",
        metavar="LIST",
        help="comma list of float32, float16, bfloat16 (default: each that a backend has)",
    )
    p.add_argument("--cases", metavar="LIST", help="comma list of cases to run (default: all)")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="save a heatmap of one case's weights, one panel per backend (needs matplotlib)",
    )
    p.add_argument(
        "--plot-case",
        metavar="CASE",
        default=PLOT_CASE,
        help=f"the case --plot draws (default: {PLOT_CASE})",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    p.add_argument(
        "--version", action="version", version=f"portable_attention {_package_version()}"
    )
    return p


def main(argv: Sequence[str] | None = None, *, run_on: Sequence[Target] | None = None) -> int:
    """Run the report with command-line arguments ``argv``; returns the exit status.

    Parameters
    ----------
    argv : sequence of str, optional
        The options (default ``sys.argv[1:]``); see ``python -m portable_attention --help``.
    run_on : sequence of Target, optional
        Run on these targets instead of the ones ``--backends``/``--devices`` select
        (tests use it to check that a wrong result makes the exit status 1).

    Returns
    -------
    int
        0 when every result agrees, 1 when one disagrees or raises, 2 for bad arguments.
    """
    p = parser()
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), as a status, not an exit
        return int(exc.code or 0)

    def fail(message: str) -> int:
        p.print_usage(sys.stderr)
        print(f"{p.prog}: error: {message}", file=sys.stderr)
        return 2

    battery = _cases.battery()
    case_names = [c.name for c in battery]
    try:
        if args.json:
            check_cli_output(args.json)
        if args.cases:
            chosen = check_cli_names(args.cases, case_names, "cases")
            battery = [c for c in battery if c.name in chosen]
        if args.plot and args.plot_case not in case_names:
            check_cli_names(args.plot_case, case_names, "plot-case")
        devices = (
            check_cli_names(args.devices, DEVICES, "devices") if args.devices else list(DEVICES)
        )
        dtypes = (
            check_cli_names(args.dtypes, list(TOLERANCES), "dtypes") if args.dtypes else TOLERANCES
        )
        backends = (
            check_cli_names(args.backends, list(DTYPES), "backends")
            if args.backends
            else installed()
        )
    except argparse.ArgumentTypeError as exc:
        return fail(str(exc))
    missing = [b for b in backends if importlib.util.find_spec(b) is None]
    if missing:
        return fail(
            f"--backends asks for {', '.join(missing)}, which is not installed here; installed: "
            f"{', '.join(installed())} (pip install the framework, or leave it out of --backends)"
        )
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return fail("--plot needs matplotlib: pip install 'portable-attention[plot]'")
    if not _can_run("bfloat16"):
        if args.dtypes and "bfloat16" in dtypes:
            return fail("--dtypes bfloat16 needs ml_dtypes: pip install ml_dtypes")
        if any("bfloat16" in DTYPES[b] for b in backends):
            print(
                "bfloat16 is left out: it needs ml_dtypes (pip install ml_dtypes)", file=sys.stderr
            )
    if run_on is None:
        run_on = targets(backends, devices, list(dtypes))
        if not run_on:
            return fail(
                f"no backend of {', '.join(backends)} has a device in {', '.join(devices)}"
                f" and a dtype in {', '.join(dtypes)} (cuda needs a GPU that torch, jax or "
                "cupy sees; cupy has no cpu; bfloat16 is on torch and jax only)"
            )

    print(_header(battery, run_on))
    show, done = _progress_printer(sys.stderr)
    try:
        rows = run(battery, run_on, progress=None if args.quiet else show)
    finally:
        done()
    print()
    print(table(rows))
    failures = [r for r in rows if not r.ok]
    for r in failures:
        if r.error:
            print(f"{r.case} {r.backend} {r.device} {r.dtype}: {r.error}", file=sys.stderr)
    if args.plot:
        plot_case = next(c for c in _cases.battery() if c.name == args.plot_case)
        panels = plot_weights(plot_case, run_on, args.plot)
        if panels:
            print(f"\nwrote {args.plot}: {plot_case.name} weights, panels {', '.join(panels)}")
        else:
            print(f"--plot: no backend gave {plot_case.name} weights to draw", file=sys.stderr)
    if args.json:
        data = {
            "tolerances": {d: {"rtol": r, "atol": a} for d, (r, a) in TOLERANCES.items()},
            "cases": {c.name: c.about for c in battery},
            "targets": [
                {"backend": t.name, "device": t.device, "dtypes": list(t.dtypes)} for t in run_on
            ],
            "rows": [r.as_dict() for r in rows],
            "failures": len(failures),
            "ok": not failures,
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    if failures:
        print(
            f"\n{len(failures)} of {len(rows)} results disagree (or failed).",
            file=sys.stderr,
        )
        return 1
    print(f"\nAll {len(rows)} results agree with the oracle and with each other.")
    return 0


# -- argument checks and messages of this module ----------------------------------------


def check_cli_names(text: str, known: Sequence[str], what: str) -> list[str]:
    """The names of a comma list option ``--what``, each one of ``known``; else the
    ``argparse.ArgumentTypeError`` the report turns into a usage error."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))  # once each
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        import argparse  # only the command line gets here: the library does not import it

        msg = (
            f"--{what} {text!r}: unknown {what} {unknown or text!r}; choose from {', '.join(known)}"
        )
        raise argparse.ArgumentTypeError(msg)
    return names


def check_cli_output(path: str) -> None:
    """``--json FILE``: a file in an existing directory, checked before the run (not after
    minutes of it); else the ``argparse.ArgumentTypeError`` of a usage error."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or os.path.isdir(path):
        import argparse

        msg = f"--json {path!r}: not a file in an existing directory"
        raise argparse.ArgumentTypeError(msg)
