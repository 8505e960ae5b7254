"""The benchmark command runs and reports what it claims (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from portable_attention import _bench

import oracle
from conftest import BACKEND_NAMES


def test_seed_formula_is_plain_attention() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    np.testing.assert_allclose(_bench.seed_formula(q, k, v), oracle.attention(q, k, v)[0])


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
        assert r["ratio"] == pytest.approx(r["anchor_ms"] / r["ours_ms"])
        assert r["path"]
    assert "ratio = anchor time / our time" in capsys.readouterr().out
