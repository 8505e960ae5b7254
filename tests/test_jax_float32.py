"""JAX in its default configuration: 64-bit types off (the rest of the suite turns them on).

Most JAX users never enable ``jax_enable_x64``. There a float64 constant or array inside
the package would be truncated to float32 with a warning, or change a result's dtype. One
fresh interpreter (x64 is read when JAX starts) runs a battery of calls with warnings as
errors, and reports each result against the float64 oracle of ``tests/oracle.py``.
"""

from __future__ import annotations

import json

import pytest

from conftest import BY_NAME
from helpers import run_python

pytestmark = pytest.mark.skipif("jax" not in BY_NAME, reason="JAX is not selected")

_SCRIPT = r"""
import json, warnings
warnings.simplefilter("error")  # a float64 truncated to float32 warns: make it fail
import jax, jax.numpy as jnp, numpy as np
assert not jax.config.jax_enable_x64
from portable_attention import attend, plan
import oracle

rng = np.random.default_rng(0)
results = []

def arrays(shape_q, shape_k, dv, dtype):
    q = rng.standard_normal(shape_q)
    k = rng.standard_normal(shape_k)
    v = rng.standard_normal((*shape_k[:-1], dv))
    return (q, k, v), tuple(jnp.asarray(x, dtype=dtype) for x in (q, k, v))

CASES = {
    "plain": dict(),
    "causal_lq_gt_lk": dict(causal=True, lq=7, lk=5),
    "causal_upper_left": dict(causal="upper_left", lq=5, lk=7),
    "window": dict(window=(2, 1)),
    "gqa": dict(hk=1),
    "softcap_scale": dict(softcap=2.0, scale=0.7),
    "empty_rows": dict(mask_rows=True),
    "bias_neginf": dict(bias=True),
    "chunked": dict(chunk_size=3, causal=True, lq=9, lk=9),
    "long_causal": dict(causal=True, lq=640, lk=640, d=16),
}
for dtype_name in ("float32", "bfloat16", "float16"):
    dtype = getattr(jnp, dtype_name)
    for name, c in CASES.items():
        lq, lk, d, hk = c.get("lq", 6), c.get("lk", 6), c.get("d", 8), c.get("hk", 2)
        (q, k, v), (jq, jk, jv) = arrays((2, 4, lq, d), (2, hk, lk, d), d, dtype)
        kw = {x: c[x] for x in ("causal", "window", "softcap", "scale", "chunk_size") if x in c}
        mask = bias = jmask = jbias = None
        if c.get("mask_rows"):
            mask = rng.random((lq, lk)) < 0.6
            mask[1] = False
            jmask = jnp.asarray(mask)
        if c.get("bias"):
            bias = rng.standard_normal((1, 4, lq, lk))
            bias[..., 2, :] = -np.inf
            jbias = jnp.asarray(bias, dtype=jnp.float32)
        # the oracle sees what JAX computes from: the inputs rounded to their dtype
        rq, rk, rv = (np.asarray(x, dtype=np.float64) for x in (jq, jk, jv))
        spec = {x: y for x, y in kw.items() if x != "chunk_size"}
        ref_out, _, ref_lse = oracle.attention(rq, rk, rv, mask=mask, bias=bias, **spec)
        f = jax.jit(
            lambda a, b, cc, m, bb: attend(a, b, cc, mask=m, bias=bb, return_lse=True, **kw)
        )
        out, lse = f(jq, jk, jv, jmask, jbias)
        def loss(a, b, cc):
            return jnp.sum(attend(a, b, cc, mask=jmask, bias=jbias, **kw).astype(jnp.float32))

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv)
        empty = np.isneginf(ref_lse)
        finite = ~empty
        out64, lse64 = np.asarray(out, dtype=np.float64), np.asarray(lse, dtype=np.float64)
        g64 = [np.asarray(g, dtype=np.float64) for g in grads]
        results.append({
            "case": f"{dtype_name}-{name}",
            "path": plan(jq, jk, jv, mask=jmask, bias=jbias, **kw).path,
            "out_dtype": str(out.dtype), "lse_dtype": str(lse.dtype),
            "grad_dtypes": [str(g.dtype) for g in grads],
            "out_err": float(np.max(np.abs(out64 - ref_out), initial=0.0)),
            "lse_err": float(np.max(np.abs(lse64[finite] - ref_lse[finite]), initial=0.0)),
            "empty_ok": bool(np.all(out64[empty] == 0) and np.all(np.isneginf(lse64[empty]))),
            "grads_finite": all(bool(np.all(np.isfinite(g))) for g in g64),
            "dq_empty_zero": bool(np.all(g64[0][empty] == 0)),
        })

# dropout needs a key; same key, same result; under jit
(q, k, v), (jq, jk, jv) = arrays((1, 2, 6, 8), (1, 2, 6, 8), 8, jnp.float32)
drop = jax.jit(lambda a, b, cc, key: attend(a, b, cc, dropout=0.3, rng=key))
key = jax.random.key(1)
d1, d2, d3 = drop(jq, jk, jv, key), drop(jq, jk, jv, key), drop(jq, jk, jv, jax.random.key(2))
results.append({
    "case": "dropout", "path": "", "out_dtype": str(d1.dtype), "lse_dtype": "float32",
    "grad_dtypes": [], "out_err": 0.0, "lse_err": 0.0, "empty_ok": True, "grads_finite": True,
    "dq_empty_zero": True, "same_key_same": bool(jnp.array_equal(d1, d2)),
    "other_key_differs": not bool(jnp.array_equal(d1, d3)),
})
print(json.dumps(results))
"""

#: Largest error against the float64 oracle (out and lse; lse is float32 for half inputs).
_LIMITS = {"float32": (1e-4, 1e-4), "bfloat16": (5e-2, 1e-4), "float16": (1e-2, 1e-4)}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    out = run_python(_SCRIPT, timeout=600)
    rows = json.loads(out.strip().splitlines()[-1])
    return {r["case"]: r for r in rows}


def test_every_case_ran(results: dict[str, dict]) -> None:
    assert len(results) == 3 * 10 + 1, sorted(results)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_results_and_gradients_without_x64(results: dict[str, dict], dtype_name: str) -> None:
    """Each call runs with x64 off (no float64 truncation warning, which the script turns
    into an error), returns the input dtype (lse float32), matches the oracle, and gives
    finite gradients in the input dtype, zero for rows with no key."""
    out_limit, lse_limit = _LIMITS[dtype_name]
    rows = [r for name, r in results.items() if name.startswith(dtype_name + "-")]
    assert rows
    for r in rows:
        assert r["out_dtype"] == dtype_name, r
        assert r["lse_dtype"] == "float32", r
        assert r["grad_dtypes"] == [dtype_name] * 3, r
        assert r["out_err"] <= out_limit, r
        assert r["lse_err"] <= lse_limit, r
        assert r["empty_ok"], r
        assert r["grads_finite"], r
        assert r["dq_empty_zero"], r


def test_dropout_without_x64(results: dict[str, dict]) -> None:
    r = results["dropout"]
    assert r["out_dtype"] == "float32"
    assert r["same_key_same"]
    assert r["other_key_differs"]
