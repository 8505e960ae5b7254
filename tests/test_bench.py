"""The benchmark command runs and reports what it claims (no timing assertions)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from portable_attention import _bench

import oracle
from conftest import BACKEND_NAMES, requires_backend


def test_seed_formula_is_plain_attention() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    np.testing.assert_allclose(_bench.seed_formula(q, k, v), oracle.attention(q, k, v)[0])


def test_seed_formula_keeps_float32() -> None:
    """The anchor computes in float32 for float32 inputs: the seed's ``np.sqrt`` would make
    it float64 under NumPy 2 and flatter every NumPy ratio by 2-3x."""
    q = np.ones((1, 2, 3, 4), dtype=np.float32)
    assert _bench.seed_formula(q, q, q).dtype == np.float32


def test_bench_reports_every_installed_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_bench, "SHAPES", [(1, 2, 16, 8)])
    monkeypatch.setattr(_bench, "DECODE", ((1, 2, 1, 8), (1, 2, 16, 8)))
    # NumPy is a dependency: it stands in where no bench backend is selected (strict only).
    backends = [b for b in ("numpy", "torch", "jax") if b in BACKEND_NAMES] or ["numpy"]
    out = tmp_path / "bench.json"
    code = _bench.main(["--backends", ",".join(backends), "--budget", "0.01", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["backend"] for r in rows} == set(backends)
    for r in rows:
        assert r["ours_ms"] > 0 and r["anchor_ms"] > 0
        assert r["ratio"] > 0  # the median of paired ratios: see the test below
        assert r["path"]
    if "torch" in backends:  # each torch shape also times SDPA against itself
        controls = [r for r in rows if r["path"] == _bench.CONTROL]
        assert len(controls) == len([r for r in rows if r["backend"] == "torch"]) // 2
    assert "ratio = anchor time / our time" in capsys.readouterr().out


def test_a_stalled_call_does_not_move_its_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a pause, this VM's host stalls single calls for milliseconds: each sample is
    the median of its calls, so one call in eight of the anchor's stalled 100x leaves the
    ratio exact (each batch's mean read the anchor 14x slower here)."""
    clock = {"now": 0.0, "calls": 0}

    def call(cost: float, ours: bool) -> None:
        clock["calls"] += 1
        stalled = not ours and clock["calls"] % 8 == 0
        clock["now"] += cost * (100.0 if stalled else 1.0)

    monkeypatch.setattr(_bench.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(_bench.time, "sleep", lambda seconds: None)
    timing = _bench._medians(
        lambda: call(0.004, ours=True),
        lambda: call(0.001, ours=False),
        budget=1.0,
        repeats=5,
        settle=0.3,
    )
    assert timing.anchor == pytest.approx(0.001)
    assert timing.ratio == pytest.approx(0.25)


def test_ratio_pairs_samples_taken_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock whose speed drifts from pair to pair of samples, with one sample of ours
    disturbed, the median of the paired ratios stays exact where the ratio of the two
    medians does not (the medians come from different moments)."""
    clock = {"now": 0.0, "calls": 0}

    def call(cost: float, ours: bool) -> None:
        clock["calls"] += 1
        step = (clock["calls"] - 1) // 2  # two warm-up calls each, then pairs of one call
        jolt = 1.3 if ours and step == 6 else 1.0  # the middle pair of 9: pairs are steps 2-10
        clock["now"] += cost * (1.0 + 0.1 * step) * jolt

    monkeypatch.setattr(_bench.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(_bench.time, "sleep", lambda seconds: None)
    timing = _bench._medians(
        lambda: call(2.0, ours=True), lambda: call(1.0, ours=False), budget=1.0, repeats=9
    )
    assert timing.ratio == pytest.approx(0.5)
    assert timing.anchor / timing.ours == pytest.approx(1.6 / 3.4)  # what the pairs correct


def test_training_rows_measure_each_call_in_its_own_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The training rows (tiny lengths here): times, peak RSS and, for JAX, compile
    seconds and temporaries, with ratios against the anchor measured in the same run."""
    backends = [b for b in ("numpy", "torch", "jax") if b in BACKEND_NAMES] or ["numpy"]
    lengths = {"torch": (64,), "jax": (64,), "jax-compile": (128,), "numpy": (64,)}
    monkeypatch.setattr(_bench, "TRAINING_SHAPES", lengths)
    rows = _bench.training_rows(backends, pairs=1)
    _bench.print_training(rows)
    calls = {(r["backend"], r["call"]) for r in rows}
    if "numpy" in backends:
        assert {("numpy", "attend_backward causal"), ("numpy", "forward causal")} <= calls
    for r in rows:
        assert r["ours_rss_mib"] > 0
        if r["call"].endswith("compile"):
            assert r["ours_compile_s"] > 0 and r["ours_temp_mib"] >= 0
            assert r["anchor_compile_s"] > 0
        else:
            assert r["ours_s"] > 0
        if r["anchor"] != "-" and not r["call"].endswith("compile"):
            assert r["time_ratio"] > 0 and r["rss_ratio"] > 0
    if "torch" in backends:
        torch_row = next(r for r in rows if r["backend"] == "torch")
        assert torch_row["path"] == "portable:dense" and torch_row["anchor"] == "SDPA causal"
    assert "speed = anchor time / our time" in capsys.readouterr().out


def test_fast_path_rows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--fast-paths`` at a tiny size (nothing compiled: Flex switched off): every call
    class of each backend, forward and forward + backward (NumPy forward only), each package
    path timed or saying why it cannot run, auto's path named, the backend's anchors timed
    (Flex's missing where the package could not use it)."""
    from portable_attention import _bench_paths, _plan

    backends = [b for b in ("torch", "jax", "numpy") if b in BACKEND_NAMES] or ["numpy"]
    monkeypatch.setattr(_bench_paths, "WINDOW", 31)
    monkeypatch.setenv("PORTABLE_ATTENTION_FLEX", "0")
    _plan.forget()  # plans are cached by the call: none made with Flex on may be reused
    out = tmp_path / "paths.json"
    argv = ["--fast-paths", "--backends", ",".join(backends), "--lengths", "128", "--rounds", "1"]
    try:
        assert _bench.main([*argv, "--json", str(out)]) == 0
    finally:
        monkeypatch.delenv("PORTABLE_ATTENTION_FLEX")
        _plan.forget()
    table = json.loads(out.read_text())["fast_paths"]
    expected = [
        (b, c, p)
        for b in backends
        for c in ("window", "packed,", "score_mod")
        for p in (("fwd",) if b == "numpy" else ("fwd", "fwd+bwd"))
    ]
    assert [(r["backend"], r["call"].split(" ")[0], r["pass"]) for r in table] == expected
    for r in table:
        assert r["length"] == 128
        assert set(r["paths"]) == set(_bench_paths.PATHS)
        assert r["auto_ms"] > 0 and r["best_ms"] <= r["auto_ms"]
        assert r["auto_path"] == r["paths"]["auto"]["path"] and ":" in r["auto_path"]
        assert tuple(r["anchors_ms"]) == _bench_paths.ANCHORS[r["backend"]]
        for name, ms in r["anchors_ms"].items():
            assert math.isnan(ms) if name == "Flex compiled" else ms > 0
        for label, cell in r["paths"].items():  # timed, or refused with the reason
            assert cell["path"].startswith("n/a: ") == math.isnan(cell["ms"]), label
    assert "auto/fst" in capsys.readouterr().out


@requires_backend("torch")
@pytest.mark.compile
def test_fast_path_rows_time_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """With Flex available, its compiled anchor is timed forward (no CPU backward: NaN
    for forward + backward), and ``fused`` runs Flex for the calls SDPA cannot take."""
    from portable_attention import _bench_paths
    from portable_attention.backends import torch_flex

    if torch_flex.unavailable("cpu") is not None:
        pytest.skip(f"Flex: {torch_flex.unavailable('cpu')}")
    monkeypatch.setattr(_bench_paths, "WINDOW", 31)
    table = _bench_paths.rows(("torch",), (256,), _bench_paths.PASSES, 1)
    for r in table:
        flex = r["anchors_ms"]["Flex compiled"]
        assert (flex > 0) if r["pass"] == "fwd" else math.isnan(flex)
        if r["pass"] == "fwd" and not r["call"].startswith("window"):
            assert r["paths"]["fused"]["path"] == "fused:torch-flex"
        if r["pass"] == "fwd+bwd" and not r["call"].startswith("window"):
            assert "no CPU backward" in r["paths"]["fused"]["path"]
