"""``python -m portable_attention bench --fast-paths``: the call classes that torch's SDPA
cannot take whole (a sliding window, packed sequences, a score_mod), each forward and
forward + backward at long context, on every path of the package that runs the call,
against the framework's own causal kernel (unmasked: the cost of full causal attention)
and, on torch, FlexAttention compiled directly with the same block mask, in the same run.

For each row: ``auto``'s path (``plan()``: the path the call runs), its time, the fastest
of the package's paths and the ratio of auto to it (<= 1.10 is the target), and auto
against each anchor (``anchor time / auto time``: >= 1, auto is at least as fast).
float32 ``[1, 8, L, 64]``. Each row times all its candidates in interleaved rounds (one
call of each per round, the order rotating) after one untimed call of each (which
compiles Flex and jit), and takes each candidate's fastest round: on a shared machine
other processes only ever slow a call down, and interleaving keeps drift from favouring
the candidate timed first.

- torch: forward under ``torch.no_grad()`` (inference: in grad mode a ``score_mod`` call
  counts as needing a backward, since its captures may require grad, and runs blockwise:
  the forward + backward rows show that path); forward + backward of ``sum(out)`` with
  q, k, v requiring grad. FlexAttention has no CPU backward in torch 2.13: its forward +
  backward cells say so. Flex compiled directly is timed where the package could use
  Flex (:func:`torch_flex.unavailable`), so ``PORTABLE_ATTENTION_FLEX=0`` compiles nothing.
- JAX (the same call classes, ``jax.jit`` of each path; forward + backward as
  ``jit(grad)``) against ``jax.nn.dot_product_attention(is_causal=True)``.
- NumPy: forward only (it has no autodiff), no anchor: auto against the portable paths.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

#: Sequence lengths of the rows (``--lengths``; the test makes them small).
LENGTHS = (4096, 8192)
#: Documents of the packed rows, of equal length.
DOCUMENTS = 8
WINDOW = 255
HEADS, DIM = 8, 64
#: Timed rounds per row (``--rounds``).
ROUNDS = 3
PASSES = ("fwd", "fwd+bwd")
#: The package's paths tried for each call (``implementation=``/``chunk_size=``).
PATHS: dict[str, dict[str, Any]] = {
    "auto": {},
    "portable": {"implementation": "portable"},
    "chunk_size=128": {"chunk_size": 128},
    "fused": {"implementation": "fused"},
}
#: The anchors of each framework's rows.
ANCHORS = {"torch": ("SDPA causal", "Flex compiled"), "jax": ("jax.nn causal",), "numpy": ()}
NAN = float("nan")


def _alibi(to_float: Callable[[Any], Any]) -> Callable[..., Any]:
    """An ALiBi-like score_mod: a linear penalty with the distance, one slope per head."""

    def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score - to_float((h + 1) * (q_idx - kv_idx)) * 0.01

    return alibi


def _classes(doc: Any, to_float: Callable[[Any], Any]) -> dict[str, dict[str, Any]]:
    """Call class -> attend's options (``doc``: ``[1, L]`` document ids)."""
    return {
        f"window ({WINDOW}, 0)": {"causal": True, "window": (WINDOW, 0)},
        f"packed, {DOCUMENTS} documents": {"causal": True, "segment_ids": doc},
        "score_mod (ALiBi), causal": {"causal": True, "score_mod": _alibi(to_float)},
    }


def _flex_masks(torch: Any, doc: Any) -> dict[str, Callable[..., Any]]:
    """Flex's mask_mod of each call class (in :func:`_classes`' order)."""
    ids = doc[0]

    def window(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (q >= kv) & (q - kv <= WINDOW)

    def packed(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (ids[q] == ids[kv]) & (q >= kv)

    def causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return q >= kv

    return dict(zip(_classes(doc, lambda x: x), (window, packed, causal), strict=True))


def _times(fns: dict[str, Callable[[], Any] | None], rounds: int) -> dict[str, float]:
    """Fastest ms of each function over ``rounds`` interleaved rounds, after one untimed
    call of each (NaN for None)."""
    live = {name: fn for name, fn in fns.items() if fn is not None}
    for fn in live.values():
        fn()
    best = dict.fromkeys(live, float("inf"))
    names = list(live)
    for i in range(rounds):
        turn = i % max(len(names), 1)
        for name in names[turn:] + names[:turn]:
            start = time.perf_counter()
            live[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: best[name] * 1e3 if name in best else NAN for name in fns}


def _row(
    backend: str, length: int, call: str, what: str, paths: dict[str, str],
    times: dict[str, float], anchors: dict[str, float],
) -> dict[str, Any]:  # fmt: skip
    timed = {k: t for k, t in times.items() if t == t}
    best = min(timed, key=timed.__getitem__)
    return {
        "backend": backend,
        "length": length,
        "call": call,
        "pass": what,
        "paths": {k: {"path": paths[k], "ms": times[k]} for k in PATHS},
        "auto_path": paths["auto"],
        "auto_ms": times["auto"],
        "best": best,
        "best_ms": timed[best],
        "anchors_ms": anchors,
    }


def _candidates(
    options: dict[str, Any],
    path_of: Callable[[dict[str, Any]], str],
    step_of: Callable[[dict[str, Any]], Callable[[], Any]],
) -> tuple[dict[str, str], dict[str, Callable[[], Any] | None]]:
    """Each of :data:`PATHS` for a call class's ``options``: the path ``path_of(opts)``
    names (``plan()``'s) and the timed step ``step_of(opts)``; where a path cannot run the
    call (``fused`` without a kernel for it), ``"n/a: <why>"`` and no step."""
    paths: dict[str, str] = {}
    fns: dict[str, Callable[[], Any] | None] = {}
    for label, extra in PATHS.items():
        opts = {**options, **extra}
        try:
            paths[label] = path_of(opts)
            fns[label] = step_of(opts)
        except (TypeError, ValueError) as err:
            paths[label], fns[label] = f"n/a: {err}", None
    return paths, fns


def _say(backend: str, length: int, call: str, what: str) -> None:
    print(f"  {backend} L={length} {call}, {what} ...", file=sys.stderr, flush=True)


def _torch_rows(lengths: tuple[int, ...], passes: tuple[str, ...], rounds: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from portable_attention import attend, plan
    from portable_attention.backends import torch_flex

    flex = None
    if torch_flex.unavailable("cpu") is None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    out: list[dict[str, Any]] = []
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        qkv = tuple(torch.randn(1, HEADS, length, DIM, generator=gen) for _ in range(3))
        doc = (torch.arange(length) * DOCUMENTS // length)[None]
        masks = _flex_masks(torch, doc)
        for name, options in _classes(doc, lambda x: x.to(torch.float32)).items():
            block_mask = None
            if flex is not None:
                block_mask = create_block_mask(masks[name], None, None, length, length, "cpu")
            for what in passes:
                _say("torch", length, name, what)
                backward = what == "fwd+bwd"
                args = tuple(x.detach().requires_grad_(backward) for x in qkv)

                def step(fn: Callable[..., Any], backward: bool = backward) -> Callable[[], Any]:
                    def run() -> Any:
                        if not backward:
                            with torch.no_grad():
                                return fn(*args)  # noqa: B023
                        for x in args:  # noqa: B023
                            x.grad = None
                        fn(*args).sum().backward()  # noqa: B023
                        return None

                    return run

                def path_of(opts: dict[str, Any], backward: bool = backward) -> str:
                    # (fused has no kernel with a CPU backward: plan in the pass's grad mode)
                    with torch.no_grad() if not backward else torch.enable_grad():
                        return plan(*args, **opts).path  # noqa: B023

                paths, fns = _candidates(
                    options,
                    path_of,
                    lambda o: step(lambda q, k, v, o=o: attend(q, k, v, **o)),
                )
                fns["SDPA causal"] = step(
                    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
                )
                fns["Flex compiled"] = None
                if flex is not None and not backward:  # no CPU backward in torch 2.13
                    score_mod = options.get("score_mod")
                    fns["Flex compiled"] = step(
                        lambda q, k, v, s=score_mod, m=block_mask: flex(
                            q, k, v, score_mod=s, block_mask=m
                        )
                    )
                times = _times(fns, rounds)
                anchors = {a: times.pop(a) for a in ANCHORS["torch"]}
                out.append(_row("torch", length, name, what, paths, times, anchors))
    return out


def _jax_rows(lengths: tuple[int, ...], passes: tuple[str, ...], rounds: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from portable_attention import attend, plan

    def anchor(q: Any, k: Any, v: Any) -> Any:
        btnh = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        return jnp.swapaxes(jax.nn.dot_product_attention(*btnh, is_causal=True), 1, 2)

    out: list[dict[str, Any]] = []
    for length in lengths:
        rng = np.random.default_rng(length)
        qkv = tuple(
            jnp.asarray(rng.standard_normal((1, HEADS, length, DIM), dtype=np.float32))
            for _ in range(3)
        )
        doc = jnp.asarray(np.arange(length) * DOCUMENTS // length)[None]
        for name, options in _classes(doc, lambda x: x.astype(jnp.float32)).items():
            for what in passes:
                _say("jax", length, name, what)

                def jitted(fn: Callable[..., Any], what: str = what) -> Callable[[], Any]:
                    if what == "fwd":
                        compiled = jax.jit(fn)
                    else:
                        compiled = jax.jit(
                            jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))
                        )
                    return lambda: jax.block_until_ready(compiled(*qkv))  # noqa: B023

                paths, fns = _candidates(
                    options,
                    lambda o: plan(*qkv, **o).path,  # noqa: B023
                    lambda o: jitted(lambda q, k, v, o=o: attend(q, k, v, **o)),
                )
                fns["jax.nn causal"] = jitted(anchor)
                times = _times(fns, rounds)
                anchors = {a: times.pop(a) for a in ANCHORS["jax"]}
                out.append(_row("jax", length, name, what, paths, times, anchors))
    return out


def _numpy_rows(lengths: tuple[int, ...], passes: tuple[str, ...], rounds: int) -> list[dict]:
    from portable_attention import attend, plan

    out: list[dict[str, Any]] = []
    for length in lengths:
        rng = np.random.default_rng(length)
        qkv = tuple(
            rng.standard_normal((1, HEADS, length, DIM), dtype=np.float32) for _ in range(3)
        )
        doc = (np.arange(length) * DOCUMENTS // length)[None]
        for name, options in _classes(doc, lambda x: x.astype(np.float32)).items():
            if "fwd" not in passes:
                continue
            _say("numpy", length, name, "fwd")
            paths, fns = _candidates(
                options,
                lambda o: plan(*qkv, **o).path,  # noqa: B023
                lambda o: functools.partial(attend, *qkv, **o),  # noqa: B023
            )
            out.append(_row("numpy", length, name, "fwd", paths, _times(fns, rounds), {}))
    return out


BACKENDS = {"torch": _torch_rows, "jax": _jax_rows, "numpy": _numpy_rows}


def rows(
    backends: tuple[str, ...] = ("torch",),
    lengths: tuple[int, ...] | None = None,
    passes: tuple[str, ...] = PASSES,
    rounds: int | None = None,
) -> list[dict[str, Any]]:
    """The rows of ``backends`` (see the module), measured now."""
    out: list[dict[str, Any]] = []
    for backend in backends:
        out += BACKENDS[backend](lengths or LENGTHS, passes, rounds or ROUNDS)
    return out


def _cell(x: float, spec: str = "9.1f") -> str:
    return format(x, spec) if x == x else format("n/a", ">" + spec.split(".")[0])


def print_rows(table: list[dict[str, Any]]) -> None:
    labels = list(PATHS)
    print(
        f"{'':<5} {'L':>5} {'call':<26} {'pass':<7} {'auto path':<20} "
        + " ".join(f"{label[:9]:>9}" for label in labels)
        + f" {'fastest':<14} {'auto/fst':>8} {'causal ms':>9} {'cau/auto':>8} "
        f"{'Flex ms':>9} {'Flex/auto':>9}"
    )
    for r in table:
        anchors = [*r["anchors_ms"].values(), NAN, NAN]
        causal, flex = anchors[0], anchors[1]
        auto = r["auto_ms"]
        print(
            f"{r['backend']:<5} {r['length']:>5} {r['call']:<26} {r['pass']:<7} "
            f"{r['auto_path']:<20} "
            + " ".join(_cell(r["paths"][label]["ms"]) for label in labels)
            + f" {r['best']:<14} {auto / r['best_ms']:>8.2f} {_cell(causal)} "
            f"{_cell(causal / auto, '8.2f')} {_cell(flex)} {_cell(flex / auto, '9.2f')}"
        )
    print(
        "ms: fastest of interleaved rounds; auto/fst: auto's time over the fastest path of "
        "the package for the call (target <= 1.10); causal: the framework's own causal "
        "kernel, unmasked (torch SDPA, jax.nn); cau/auto, Flex/auto: the anchor's time over "
        "auto's (>= 1: auto is at least as fast); n/a: the path refuses the call (torch's "
        "Flex has no CPU backward in torch 2.13)"
    )
    for r in table:
        refused = {k: p["path"] for k, p in r["paths"].items() if p["path"].startswith("n/a")}
        ran = {k: p["path"] for k, p in r["paths"].items() if k not in refused}
        print(f"  {r['backend']} L={r['length']} {r['call']}, {r['pass']}: {ran}")
