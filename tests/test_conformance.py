"""The conformance table (``docs/conformance.md``, made by ``benchmarks/conformance.py``)
stays true: a fast subset of its cases runs here on the kernels installed in the test
environment (this package's paths, torch SDPA's math backend, ``jax.nn``), and each
verdict asserted is compared with the cell the page records, so a dependency update that
changes one fails here instead of leaving the page wrong.

Only the contract (this package's paths) and the kernels' documented conventions are
asserted: torch SDPA's boolean ``attn_mask`` (True takes part), its upper-left
``is_causal`` (``ones(L, S).tril()`` in its documentation), ``enable_gqa``, a value head
dim ``Ev`` of its own; ``jax.nn``'s boolean mask, upper-left ``is_causal`` and grouped
heads. What they do on rows with no key is not documented: the page records it, this
file does not assert it.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from portable_attention.testing import CASES

from conftest import requires_backend

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "conformance.py"
PAGE = ROOT / "docs" / "conformance.md"


@pytest.fixture(scope="module")
def conformance() -> ModuleType:
    spec = importlib.util.spec_from_file_location("conformance", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["conformance"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def recorded() -> dict[str, dict[str, str]]:
    """The page's table: kernel name -> case -> cell (bold marks removed)."""
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    start = lines.index("## The table")
    header = next(line for line in lines[start:] if line.startswith("| kernel |"))
    cases = [c.strip().strip("`") for c in header.strip("|").split("|")[1:]]
    table: dict[str, dict[str, str]] = {}
    for line in lines[lines.index(header) + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip().replace("**", "") for c in re.split(r"(?<!\\)\|", line.strip("|"))]
        table[cells[0].replace("\\|", "|")] = dict(zip(cases, cells[1:], strict=True))
    return table


def run(conformance: ModuleType, key: str, cases: list[str]) -> dict[str, str]:
    """Run one kernel's cases; each case's cell, checked against the page's."""
    kernel = conformance.BY_KEY[key]
    result = conformance.run_kernel(kernel, cases)
    assert not result.skipped, result.skipped
    cells = {name: result.cases[name][1] for name in cases}
    page = recorded()[kernel.name]
    assert {n: page[n] for n in cases} == cells, (
        f"{kernel.name}: the page records {[page[n] for n in cases]}, this run gives "
        f"{list(cells.values())}; rerun benchmarks/conformance.py --write and read why"
    )
    return cells


def test_the_page_lists_every_kernel_and_case(conformance: ModuleType) -> None:
    table = recorded()
    assert list(table) == [k.name for k in conformance.KERNELS]
    for name, cells in table.items():
        assert list(cells) == list(CASES), name
        assert all(cells.values()), f"{name}: an empty cell"
    for kernel in conformance.KERNELS:  # a kernel not run here says why, never vanishes
        if kernel.gpu:
            assert set(table[kernel.name].values()) == {"skipped"}
            assert f"Skipped: {kernel.gpu}." in PAGE.read_text(encoding="utf-8")


def test_cells_name_conventions_not_bugs(conformance: ModuleType) -> None:
    sdpa = conformance.BY_KEY["torch-sdpa-math"]
    keywords = {"causal": "is_causal", "causal_alignment": "upper_left"}
    classify = conformance.classify
    assert classify(sdpa, keywords, "causal_lq_gt_lk", "ok") == "ok (upper-left)"
    assert classify(sdpa, keywords, "causal", "ok") == "ok"
    assert classify(sdpa, keywords, "empty_rows", "departs") == "DEPARTS"
    assert classify(sdpa, keywords, "gqa", "error") == "ERROR"
    jax_nn = conformance.BY_KEY["jax-nn"]
    assert classify(jax_nn, keywords, "dv_ne_dk", "error") == "convention"
    assert classify(jax_nn, keywords, "window", "skipped") == "skipped"


ATTEND_CASES = [
    "mask",
    "causal_lq_gt_lk",
    "padding",
    "window",
    "window_causal",
    "sinks",
    "grad_empty_rows",
]


@pytest.mark.parametrize(
    "key",
    [
        "attend-numpy",
        "attend-numpy-chunked",
        pytest.param("attend-torch", marks=requires_backend("torch")),
        pytest.param("attend-torch-chunked", marks=requires_backend("torch")),
        pytest.param("attend-jax", marks=requires_backend("jax")),
    ],
)
def test_attend_meets_the_contract(conformance: ModuleType, key: str) -> None:
    cells = run(conformance, key, ATTEND_CASES)
    differentiable = not key.startswith("attend-numpy")
    expected = {n: "ok" for n in ATTEND_CASES}
    if not differentiable:
        expected["grad_empty_rows"] = "skipped"
    assert cells == expected


@requires_backend("torch")
def test_torch_sdpa_math_documented_conventions(conformance: ModuleType) -> None:
    cells = run(conformance, "torch-sdpa-math", ["mask", "causal_lq_lt_lk", "gqa", "dv_ne_dk"])
    assert cells == {
        "mask": "ok",
        "causal_lq_lt_lk": "ok (upper-left)",
        "gqa": "ok",
        "dv_ne_dk": "ok",
    }


@requires_backend("jax")
def test_jax_nn_documented_conventions(conformance: ModuleType) -> None:
    cells = run(conformance, "jax-nn", ["mask", "causal_lq_lt_lk", "gqa", "mqa"])
    assert cells == {
        "mask": "ok",
        "causal_lq_lt_lk": "ok (upper-left)",
        "gqa": "ok",
        "mqa": "ok",
    }


@requires_backend("jax")
def test_jax_lax_map_over_the_batch_is_bitwise_batch_invariant() -> None:
    """docs/contract.md's recipe: attend under ``jax.lax.map`` over the batch gives a
    sequence the same bits in a batch of 4 as in a batch of 1, on the auto and the
    chunked path (where the batched call does not, on the CPU)."""
    import jax
    import jax.numpy as jnp
    from portable_attention import attend

    rng = np.random.default_rng(27)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 2, 256, 32)), jnp.float32) for _ in range(3))
    for options in ({}, {"chunk_size": 64}):

        def one(qkv: Any, options: dict[str, Any] = options) -> Any:
            return attend(*(x[None] for x in qkv), causal=True, **options)[0]

        mapped = jax.jit(lambda q, k, v, one=one: jax.lax.map(one, (q, k, v)))
        batch = np.asarray(mapped(q, k, v))[2]
        alone = np.asarray(mapped(q[2:3], k[2:3], v[2:3]))[0]
        np.testing.assert_array_equal(batch, alone, err_msg=str(options))
