"""The consistency report (``python -m portable_attention``): its table, JSON, plot and exit codes.

The report runs in-process through ``_report.main`` on NumPy plus the selected torch and
jax backends, on a few cases to stay fast. A wrong result is injected as a real extra
target whose call perturbs ``attend``'s real output: no framework is mocked.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from portable_attention import __main__ as cli
from portable_attention import _cases, _report, attend, plan
from portable_attention.testing import reference_attention, tolerance

import oracle
from conftest import BACKEND_NAMES, requires_backend

# Backends the report runs here: NumPy (always installed) and the selected frameworks.
REPORT_BACKENDS = ["numpy"] + [
    b for b in ("array_api_strict", "torch", "jax") if b in BACKEND_NAMES
]
CASES = "plain,masked_rows,weights"


def _rows_of(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    rows: list[dict[str, Any]] = data["rows"]
    return rows


def _numpy_target(label: str = "", call: Any = attend) -> _report.Target:
    return _report.Target("numpy", "cpu", ("float32",), label=label, call=call)


# -- the battery and its oracle -------------------------------------------------------------------


def test_oracle_matches_independent_float64_oracle() -> None:
    """The report's oracle (testing.reference_attention, float64) equals tests/oracle.py."""
    battery = _cases.battery()
    assert [c.name for c in battery] == [
        "plain",
        "causal",
        "padding",
        "window",
        "gqa",
        "bias",
        "softcap",
        "masked_rows",
        "weights",
        "chunked",
    ]
    for case in battery:
        out, weights = _cases.oracle(case, "float16")
        options = {
            n: v for n, v in case.options.items() if n not in ("chunk_size", "return_weights")
        }
        arrays = {n: _cases.rounded(a, "float16").astype(a.dtype) for n, a in case.arrays.items()}
        ref_out, ref_weights, _ = oracle.attention(**arrays, **options)
        assert out.dtype == np.float64 and out.shape == ref_out.shape
        np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-13, err_msg=case.name)
        np.testing.assert_allclose(weights, ref_weights, rtol=1e-12, atol=1e-13)


def test_oracle_is_the_independent_reference_not_attend() -> None:
    """The report's oracle is ``testing.reference_attention`` on the rounded inputs, bit for
    bit; not ``attend(..., implementation="portable")``, which a bug of the portable code
    would share."""
    assert not hasattr(_cases, "attend")
    for case in _cases.battery():
        arrays = {n: _cases.rounded(a, "bfloat16").astype(a.dtype) for n, a in case.arrays.items()}
        options = {
            n: v for n, v in case.options.items() if n not in ("chunk_size", "return_weights")
        }
        q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
        ref = reference_attention(q, k, v, **arrays, **options)
        out, weights = _cases.oracle(case, "bfloat16")
        np.testing.assert_array_equal(out, ref.out, err_msg=case.name)
        np.testing.assert_array_equal(weights, ref.weights, err_msg=case.name)


def test_battery_covers_the_contract_cases() -> None:
    by_name = {c.name: c for c in _cases.battery()}
    causal = by_name["causal"]
    assert causal.arrays["q"].shape[-2] != causal.arrays["k"].shape[-2]
    gqa = by_name["gqa"]
    assert gqa.arrays["q"].shape[-3] == 4 * gqa.arrays["k"].shape[-3]
    out, weights = _cases.oracle(by_name["masked_rows"], "float32")
    empty = ~by_name["masked_rows"].arrays["mask"].any(axis=-1)  # [B, 1, Lq]
    assert empty.sum() == 2 * 3  # rows 0, 5, 11 in both batches
    assert np.all(out[np.broadcast_to(empty, out.shape[:-1])] == 0.0)
    assert np.all(weights.sum(-1)[np.broadcast_to(empty, weights.shape[:-1])] == 0.0)


def test_rounded_is_exact_in_each_dtype() -> None:
    a = np.array([1.0, 1.00390625, 1.005859375, 3.14159, -2.7e-3])
    assert _cases.rounded(a, "float16").dtype == np.float16
    b16 = _cases.rounded(a, "bfloat16")
    assert b16.dtype == np.float32
    np.testing.assert_array_equal(b16, [1.0, 1.0, 1.0078125, 3.140625, -0.0027008056640625])
    # bfloat16 values: the low 16 bits of the float32 are zero
    assert np.all(b16.view(np.uint32) & 0xFFFF == 0)


def test_tolerances_are_the_packages_table() -> None:
    for dtype, (rtol, atol) in _report.TOLERANCES.items():
        assert (rtol, atol) == tolerance(dtype, "out") == tolerance(dtype, "weights")
    assert list(_report.TOLERANCES) == ["float32", "float16", "bfloat16"]


@requires_backend("torch")
def test_bfloat16_is_left_out_without_ml_dtypes() -> None:
    """ml_dtypes rounds the inputs to bfloat16: without it the report runs the other dtypes
    and says so (asked for by --dtypes, it is a usage error)."""
    code = (
        "import sys\n"
        "sys.modules['ml_dtypes'] = None  # as if not installed: importing it fails\n"
        "from portable_attention import _report\n"
        "args = ['--backends', 'torch', '--cases', 'plain', '-q']\n"
        "print('status', _report.main(args))\n"
        "print('status', _report.main([*args, '--dtypes', 'bfloat16']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "bfloat16 is left out: it needs ml_dtypes" in done.stderr
    assert "--dtypes bfloat16 needs ml_dtypes: pip install ml_dtypes" in done.stderr
    assert "All 2 results agree" in done.stdout  # float32 and float16
    assert [line for line in done.stdout.splitlines() if line.startswith("status")] == [
        "status 0",
        "status 2",
    ]


@requires_backend("torch")
def test_bfloat16_rounding_matches_torch() -> None:
    import torch

    a = np.random.default_rng(1).standard_normal(1000)
    ours = _cases.rounded(a, "bfloat16")
    theirs = torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(ours, theirs)


# -- a normal run ---------------------------------------------------------------------------------


def test_report_agrees_and_prints_table_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "report.json"
    argv = ["--backends", ",".join(REPORT_BACKENDS), "--cases", CASES, "--json", str(out_json)]
    assert _report.main([*argv, "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # --quiet: no progress line

    lines = captured.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("case "))
    columns = [c for c in lines[header].split("  ") if c.strip()]
    assert [c.strip() for c in columns] == list(_report.COLUMNS)
    assert set(lines[header + 1]) <= {"-", " "}
    dtypes = {b: _report.DTYPES[b] for b in REPORT_BACKENDS}
    expected_rows = 3 * sum(len(d) for d in dtypes.values())
    body = lines[header + 2 : header + 2 + expected_rows]
    assert all(line.split()[0] in CASES.split(",") for line in body)
    assert all(line.split()[-2] == "agree" for line in body)
    assert "rtol=0.0001 atol=1e-05" in captured.out  # the tolerances are stated
    assert f"All {expected_rows} results agree" in captured.out

    data = json.loads(out_json.read_text())
    assert data["ok"] is True and data["failures"] == 0
    assert data["tolerances"]["float32"] == {"rtol": 1e-4, "atol": 1e-5}
    rows = data["rows"]
    assert len(rows) == expected_rows
    assert {(r["backend"], r["dtype"]) for r in rows} == {
        (b, d) for b, ds in dtypes.items() for d in ds
    }
    for r in rows:
        rtol, atol = _report.TOLERANCES[r["dtype"]]
        assert r["ok"] is True and r["verdict"] == "agree" and r["error"] == ""
        assert 0 <= r["max_abs"] <= atol + rtol * 4  # |outputs| < 4 here
        assert 0 <= r["max_rel"] <= r["max_abs"] * 10
        assert r["ms"] > 0
        assert r["device"] == "cpu"
        # compared with the other backends exactly where another one ran this dtype
        ran = [b for b, ds in dtypes.items() if r["dtype"] in ds]
        assert (r["vs_others"] is not None) == (len(ran) > 1), (r, ran)
    # The path column is what plan() says for that call.
    by_key = {(r["case"], r["backend"], r["dtype"]): r for r in rows}
    case = next(c for c in _cases.battery() if c.name == "plain")
    q, k, v = (case.arrays[n].astype(np.float32) for n in "qkv")
    assert by_key[("plain", "numpy", "float32")]["path"] == plan(q, k, v).path
    assert plan(q, k, v).path == "portable:dense"  # the battery's calls: under 64K scores
    assert by_key[("weights", "numpy", "float32")]["path"] == "portable:dense"
    if "torch" in REPORT_BACKENDS:
        assert by_key[("plain", "torch", "float32")]["path"] == "fused:torch"
        assert by_key[("weights", "torch", "float32")]["path"] == "portable:dense"
        assert by_key[("plain", "torch", "bfloat16")]["max_abs"] > 1e-4  # bfloat16 is coarse


def test_whole_battery_in_float32(tmp_path: Path) -> None:
    """Every case on every selected backend (float32 only, to stay fast)."""
    out_json = tmp_path / "r.json"
    argv = ["--backends", ",".join(REPORT_BACKENDS), "--dtypes", "float32", "-q"]
    assert _report.main([*argv, "--json", str(out_json)]) == 0
    rows = _rows_of(out_json)
    assert len(rows) == len(_cases.battery()) * len(REPORT_BACKENDS)
    assert {r["dtype"] for r in rows} == {"float32"}
    assert all(r["ok"] for r in rows)  # within the table's float32 row, by the report's check
    paths = {(r["case"], r["backend"]): r["path"] for r in rows}
    assert paths[("chunked", "numpy")] == "portable:blockwise"
    if "torch" in REPORT_BACKENDS:
        assert paths[("softcap", "torch")] == "portable:dense"  # SDPA has no softcap
        assert paths[("masked_rows", "torch")] == "fused:torch"


def test_table_orders_by_case_then_dtype() -> None:
    rows = _report.run(
        [c for c in _cases.battery() if c.name in ("plain", "bias")],
        [_report.Target("numpy", "cpu", ("float32", "float16"))],
    )
    assert [(r.case, r.dtype) for r in rows] == [
        ("plain", "float32"),
        ("plain", "float16"),
        ("bias", "float32"),
        ("bias", "float16"),
    ]
    assert all(r.ok and r.vs_others is None for r in rows)  # one backend: nothing to pair
    assert all(isinstance(x, np.ndarray) and x.dtype == np.float64 for r in rows for x in r.result)


def test_progress_lines_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert _report.main(["--backends", "numpy", "--cases", "plain,gqa"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "[1/4] numpy cpu float32 plain",
        "[2/4] numpy cpu float32 gqa",
        "[3/4] numpy cpu float16 plain",
        "[4/4] numpy cpu float16 gqa",
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_rewrites_one_line_on_a_tty() -> None:
    stream = _Terminal()
    show, done = _report._progress_printer(stream)
    show(1, 12, "jax cpu bfloat16 window")
    show(2, 12, "jax cpu bfloat16 gqa")
    done()
    text = stream.getvalue()
    assert "\n" not in text
    assert text.startswith("\r[1/12] jax cpu bfloat16 window\r[2/12] jax cpu bfloat16 gqa")
    assert text.endswith("\r" + " " * len("[1/12] jax cpu bfloat16 window") + "\r")


@requires_backend("torch")
def test_plot_writes_one_panel_per_backend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image

    png = tmp_path / "weights.png"
    argv = ["--backends", "numpy,torch", "--cases", "window", "--plot", str(png), "-q"]
    assert _report.main(argv) == 0
    assert "panels numpy cpu, torch cpu" in capsys.readouterr().out
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100
    assert image.shape[1] > 1.5 * image.shape[0]  # two panels side by side
    assert image.std() > 0.05  # not a blank canvas


def test_plot_with_numpy_only(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image

    png = tmp_path / "w.png"
    argv = ["--backends", "numpy", "--cases", "plain", "--plot", str(png), "--plot-case", "causal"]
    assert _report.main([*argv, "-q"]) == 0
    assert matplotlib.image.imread(png).shape[-1] in (3, 4)


# -- failures: exit status 1 ----------------------------------------------------------------------


def _shifted(shift: Any) -> Any:
    """A call that runs the real ``attend`` and moves its output by ``shift(out)``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        result = attend(*args, **kwargs)
        if isinstance(result, tuple):
            return (result[0] + shift(result[0]), *result[1:])
        return result + shift(result)

    return call


def test_exit_1_when_a_backend_disagrees(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "r.json"
    broken = _numpy_target("broken", _shifted(lambda out: np.float32(1e-3)))
    code = _report.main(
        ["--cases", "plain,weights", "-q", "--json", str(out_json)],
        run_on=[_numpy_target(), broken],
    )
    assert code == 1
    captured = capsys.readouterr()
    assert "2 of 4 results disagree" in captured.err
    rows = {(r["case"], r["backend"]): r for r in _rows_of(out_json)}
    for case in ("plain", "weights"):
        assert rows[(case, "numpy")]["verdict"] == "agree"
        bad = rows[(case, "broken")]
        assert bad["verdict"] == "DISAGREE" and bad["ok"] is False
        assert bad["max_abs"] == pytest.approx(1e-3, rel=1e-2)
        assert rows[(case, "numpy")]["vs_others"] == pytest.approx(1e-3, rel=1e-2)
    assert json.loads(out_json.read_text())["ok"] is False
    assert any("broken" in line and "DISAGREE" in line for line in captured.out.splitlines())


def test_nan_result_disagrees(tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    nan = _numpy_target(
        "nan", _shifted(lambda out: np.where(out == out.max(), np.nan, 0).astype(out.dtype))
    )
    assert _report.main(["--cases", "plain", "-q", "--json", str(out_json)], run_on=[nan]) == 1
    (row,) = _rows_of(out_json)
    assert row["verdict"] == "DISAGREE" and row["max_abs"] == "nan"


def test_pairwise_disagreement_within_oracle_tolerance() -> None:
    """Two results each inside the oracle tolerance, but apart by more than it."""
    rtol, atol = _report.TOLERANCES["float32"]

    def step(sign: float) -> Any:
        return lambda out: (sign * 0.7 * (atol + rtol * np.abs(out))).astype(out.dtype)

    up, down = _numpy_target("up", _shifted(step(1.0))), _numpy_target("down", _shifted(step(-1.0)))
    cases = [c for c in _cases.battery() if c.name == "plain"]
    rows = {r.backend: r for r in _report.run(cases, [up, down])}
    assert rows["up"].max_abs is not None and rows["up"].max_abs < atol + rtol * 4
    assert rows["up"].verdict == "DISAGREE vs down/cpu"
    assert rows["down"].verdict == "DISAGREE vs up/cpu"
    assert rows["up"].vs_others == pytest.approx(2 * 0.7 * (atol + rtol * 1.6), rel=0.2)


def test_wrong_dtype_or_framework_disagrees(tmp_path: Path) -> None:
    """A result in another dtype (a silent upcast) or framework is a disagreement."""
    out_json = tmp_path / "r.json"
    upcast = _numpy_target("upcast", _shifted(lambda out: np.zeros(out.shape, np.float64)))
    listed = _numpy_target("torch_out", lambda *a, **kw: _as_torch(attend(*a, **kw)))
    run_on = [upcast] + ([listed] if "torch" in BACKEND_NAMES else [])
    assert _report.main(["--cases", "plain", "-q", "--json", str(out_json)], run_on=run_on) == 1
    rows = {r["backend"]: r for r in _rows_of(out_json)}
    assert rows["upcast"]["verdict"] == "DISAGREE"
    assert rows["upcast"]["error"] == "returned a numpy float64 array for numpy float32 inputs"
    assert rows["upcast"]["max_abs"] < 1e-6  # the values themselves are right
    if "torch" in BACKEND_NAMES:
        assert (
            rows["torch_out"]["error"] == "returned a torch float32 array for numpy float32 inputs"
        )


def _as_torch(x: Any) -> Any:
    import torch

    return torch.from_numpy(np.asarray(x))


def test_exit_1_when_a_call_raises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def fails(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        return attend(q, k[..., :3], v, **kwargs)  # Dk of k no longer matches q: ValueError

    png = tmp_path / "none.png"
    argv = ["--cases", "plain", "-q", "--plot", str(png), "--plot-case", "plain"]
    assert _report.main(argv, run_on=[_numpy_target("fails", fails)]) == 1
    captured = capsys.readouterr()
    assert "ERROR" in captured.out
    assert "plain fails cpu float32: ValueError" in captured.err
    assert "--plot: no backend gave plain weights to draw" in captured.err
    assert not png.exists()


# -- bad arguments: exit status 2 -----------------------------------------------------------------


def test_exit_2_for_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert _report.main(["--backends", "numpy,tensorflow"]) == 2
    err = capsys.readouterr().err
    assert "unknown backends ['tensorflow']" in err and "choose from numpy" in err


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_exit_2_for_backend_not_installed(capsys: pytest.CaptureFixture[str]) -> None:
    assert _report.main(["--backends", "numpy,cupy"]) == 2
    err = capsys.readouterr().err
    assert "--backends asks for cupy, which is not installed here" in err


def test_exit_2_for_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert _report.main(["--cases", "plain,nonsense"]) == 2
    assert "unknown cases ['nonsense']" in capsys.readouterr().err
    assert _report.main(["--devices", "tpu"]) == 2
    assert _report.main(["--plot", "x.png", "--plot-case", "nope"]) == 2
    assert _report.main(["--no-such-option"]) == 2
    capsys.readouterr()


def test_exit_2_when_nothing_matches(capsys: pytest.CaptureFixture[str]) -> None:
    # NumPy never runs on CUDA: asking for numpy on cuda alone has nothing to run.
    assert _report.main(["--backends", "numpy", "--devices", "cuda"]) == 2
    assert "no backend of numpy has a device in cuda" in capsys.readouterr().err
    assert _report.main(["--backends", "numpy", "--dtypes", "bfloat16"]) == 2
    assert "and a dtype in bfloat16" in capsys.readouterr().err
    assert _report.main(["--dtypes", "float64"]) == 2
    assert "unknown dtypes ['float64']" in capsys.readouterr().err


# -- the command line -----------------------------------------------------------------------------


def test_help_lists_options_and_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("--backends", "--devices", "--json", "--plot", "--quiet", "demo", "bench"):
        assert word in out


def test_demo_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "NumPy weights [1, 2, 4, 4]" in out
    assert cli.main(["demo", "--help"]) == 0
    assert "usage: python -m portable_attention demo" in capsys.readouterr().out
    assert cli.main(["demo", "extra"]) == 2


def test_bench_subcommand_dispatches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "--budget" in capsys.readouterr().out


def test_module_entry_point_runs_the_report(tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    args = ["--backends", "numpy", "--cases", "plain", "--json", str(out_json)]
    done = subprocess.run(
        [sys.executable, "-m", "portable_attention", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "[2/2] numpy cpu float16 plain" in done.stderr  # not a tty: one line each
    assert "All 2 results agree" in done.stdout
    rows = _rows_of(out_json)
    assert [(r["dtype"], r["path"]) for r in rows] == [
        ("float32", "portable:dense"),
        ("float16", "portable:dense"),
    ]
    assert all(math.isfinite(r["max_abs"]) for r in rows)


def test_demo_verdict_counts_nan_as_disagreement() -> None:
    """A NaN difference in any output disagrees (``max(0.0, nan)`` is 0.0: not used)."""
    assert cli._verdict(0.0, 0.0) == "agree"
    assert cli._verdict(0.0, math.nan) == "DISAGREE"
    assert cli._verdict(math.nan, 0.0) == "DISAGREE"
    assert cli._verdict(1e-3) == "DISAGREE"


def test_json_path_checked_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A ``--json`` file in a missing directory is a usage error at once (status 2), not a
    traceback after the whole battery."""
    assert _report.main(["--json", str(tmp_path / "missing" / "report.json")]) == 2
    assert "--json" in capsys.readouterr().err


def test_repeated_cli_names_count_once() -> None:
    from portable_attention._report import check_cli_names

    assert check_cli_names("torch,numpy,torch", ["numpy", "torch"], "backends") == [
        "torch",
        "numpy",
    ]


def test_report_runs_dask_and_ndonnx_rows(tmp_path: Path) -> None:
    """``--backends numpy,dask,ndonnx``: dask's rows compute the call's graph, ndonnx's
    run an ONNX model of it (symbolic batch and lengths) in onnxruntime; every row agrees
    with the oracle and with NumPy's. The default report leaves them out (they are asked
    for by name)."""
    pytest.importorskip("dask", reason="dask is a test dependency (the test group)")
    pytest.importorskip("ndonnx", reason="ndonnx is a test dependency (the test group)")
    pytest.importorskip("onnxruntime", reason="onnxruntime is a test dependency")
    assert not {"dask", "ndonnx"} & set(_report.installed())
    out_json = tmp_path / "report.json"
    argv = ["--backends", "numpy,dask,ndonnx", "--cases", "causal,gqa,masked_rows"]
    assert _report.main([*argv, "--dtypes", "float32", "--json", str(out_json), "--quiet"]) == 0
    rows = _rows_of(out_json)
    assert {r["backend"] for r in rows} == {"numpy", "dask", "ndonnx"}
    assert len(rows) == 9 and all(r["ok"] and r["vs_others"] is not None for r in rows)
    paths = {(r["backend"], r["case"]): r["path"] for r in rows}
    assert paths["dask", "causal"] == "per-chunk:dask"
    assert paths["dask", "masked_rows"] == "portable:dense"  # a mask: the portable path
    assert paths["ndonnx", "causal"] == "portable:dense"  # symbolic lengths
