"""Benchmark of issue 18's options: mask_mod block plans, packed sequences, attention sinks.

    python benchmarks/modern_bench.py                  # [1, 8, 8192, 64] float32 (minutes)
    python benchmarks/modern_bench.py --quick          # L = 1024 (seconds)
    python benchmarks/modern_bench.py --length 4096 --repeats 5 --only mods segments

Prints one Markdown table, measured in one run (each row as soon as it is measured). Each
row times a call and its baseline on the same arrays (one untimed warm-up call each, then
``--repeats`` timed calls of each, alternating) and reports the best (smallest)
``time.perf_counter`` time of each, their ratio and the ``plan().path`` of both calls:

- ``mods``: NumPy, a sliding-window ``mask_mod`` (``(q_idx >= kv_idx) & (q_idx - kv_idx
  < 128)``: each query sees itself and the 127 keys before it) as a
  ``masks.block_plan(..., block_size=128)`` and as a plain function, and ``window=(127,
  0)`` (the same mask), each against the unmasked call. ``speed-up = baseline / call``
  (target: >= 5x for the block plan).
- ``segments``: NumPy, 16 packed sequences of equal length filling L, passed as
  ``segment_ids`` against the same call with the dense mask ``masks.segment_mask(ids)``,
  with and without ``causal=True``. ``speed-up = dense mask / segment ids`` (target >= 4x).
- ``sinks``: ``sinks=`` (one logit per head) against the same call without: NumPy with
  ``implementation="auto"``; torch float32 with ``implementation="portable"`` and with
  ``chunk_size=--chunk-size``, forward and forward + backward of ``sum(out)``; JAX under
  ``jax.jit``, forward and ``jit(grad)``. ``overhead = call / baseline - 1`` (target <=
  10%). torch and JAX rows are left out where the framework is not installed.

- ``flex``: torch float32, the calls auto gives FlexAttention on the CPU (a sliding
  window of ``--window`` keys, ``--segments`` packed sequences with ``causal``, an ALiBi
  ``score_mod`` with ``causal``), forward and forward + backward, against
  ``implementation="portable"`` (the blockwise path, what auto took before), against
  ``flex_attention`` compiled and called directly with a BlockMask built beforehand
  (forward only: Flex has no CPU backward) and against SDPA's plain causal attention.
  ``speed-up = baseline / call``. The first call of each compiles (seconds, untimed).

Times are wall-clock on whatever else the machine is running: compare ratios, not times,
and run it twice where they matter.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from portable_attention import attend, masks, plan


@dataclass(frozen=True)
class Row:
    """One line of the table: a call against its baseline on the same arrays."""

    section: str
    call: str
    path: str
    seconds: float
    baseline: str
    base_path: str
    base_seconds: float
    measure: str  # "speed-up" (baseline / call) or "overhead" (call / baseline - 1)

    @property
    def ratio(self) -> str:
        if self.measure == "speed-up":
            return f"speed-up {self.base_seconds / self.seconds:.2f}x"
        return f"overhead {(self.seconds / self.base_seconds - 1) * 100:+.1f}%"


def best_times(
    call: Callable[[], Any], baseline: Callable[[], Any], repeats: int
) -> tuple[float, float]:
    """Best-of-``repeats`` seconds of ``call`` and ``baseline``, one warm-up each, the
    timed calls alternating (and taking turns going first) so that the machine's drift
    hits both."""
    call()
    baseline()
    ours: list[float] = []
    theirs: list[float] = []
    for i in range(repeats):
        turn = ((call, ours), (baseline, theirs))
        for fn, times in turn if i % 2 == 0 else turn[::-1]:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return min(ours), min(theirs)


def compare(
    args: argparse.Namespace,
    section: str,
    name: str,
    call: tuple[Callable[[], Any], str],
    baseline: tuple[str, Callable[[], Any], str],
    measure: str,
) -> Row:
    """Time ``call = (fn, path)`` against ``baseline = (name, fn, path)``; print the row."""
    (fn, path), (base_name, base_fn, base_path) = call, baseline
    t, tb = best_times(fn, base_fn, args.repeats)
    result = Row(section, name, path, t, base_name, base_path, tb, measure)
    print_row(result)
    return result


def _qkv(length: int, heads: int, dim: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, heads, length, dim), dtype=np.float32) for _ in range(3)]


def mods_section(args: argparse.Namespace) -> list[Row]:
    q, k, v = _qkv(args.length, args.heads, args.dim)
    w = args.window

    def sliding(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w)

    block = masks.block_plan(sliding, args.length, args.length, block_size=128)
    unmasked = ("unmasked", lambda: attend(q, k, v), plan(q, k, v).path)
    rows = []
    for name, opts in (
        (f"mask_mod block plan ({block.density:.1%} of blocks)", {"mask_mod": block}),
        ("mask_mod plain function", {"mask_mod": sliding}),
        (f"window=({w - 1}, 0)", {"window": (w - 1, 0)}),
    ):
        call = (lambda o=opts: attend(q, k, v, **o), plan(q, k, v, **opts).path)
        rows.append(compare(args, "mods", name, call, unmasked, "speed-up"))
    return rows


def segments_section(args: argparse.Namespace) -> list[Row]:
    q, k, v = _qkv(args.length, args.heads, args.dim)
    n = args.segments
    lengths = np.full(n, args.length // n)
    lengths[-1] += args.length - lengths.sum()
    ids = masks.segment_ids_from_lengths(lengths)
    dense = masks.segment_mask(ids)
    rows = []
    for causal in (False, True):
        call = (
            lambda c=causal: attend(q, k, v, segment_ids=ids, causal=c),
            plan(q, k, v, segment_ids=ids, causal=causal).path,
        )
        baseline = (
            "mask=segment_mask(ids)",
            lambda c=causal: attend(q, k, v, mask=dense, causal=c),
            plan(q, k, v, mask=dense, causal=causal).path,
        )
        name = f"{n} segments as segment_ids, causal={causal}"
        rows.append(compare(args, "segments", name, call, baseline, "speed-up"))
    return rows


def sinks_section(args: argparse.Namespace) -> list[Row]:
    q, k, v = _qkv(args.length, args.heads, args.dim)
    sinks = np.random.default_rng(1).standard_normal(args.heads, dtype=np.float32)
    call = (lambda: attend(q, k, v, sinks=sinks), plan(q, k, v, sinks=sinks).path)
    baseline = ("no sinks", lambda: attend(q, k, v), plan(q, k, v).path)
    rows = [compare(args, "sinks", "NumPy auto, forward", call, baseline, "overhead")]
    rows += _torch_sinks(args, q, k, v, sinks)
    rows += _jax_sinks(args, q, k, v, sinks)
    return rows


def _torch_sinks(args: argparse.Namespace, *arrays: np.ndarray) -> list[Row]:
    try:
        import torch
    except ImportError:
        print("torch is not installed: its sinks rows are left out", file=sys.stderr)
        return []
    time.sleep(0.3)  # NumPy's BLAS threads spin for a while after their last call
    q, k, v, sinks = (torch.from_numpy(a.copy()) for a in arrays)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks)]

    def forward(opts: dict[str, Any], s: Any) -> Any:
        with torch.no_grad():
            return attend(q, k, v, sinks=s, **opts)

    def train(opts: dict[str, Any], with_sinks: bool) -> None:
        for x in leaves:
            x.grad = None
        s = leaves[3] if with_sinks else None
        attend(*leaves[:3], sinks=s, **opts).sum().backward()

    rows = []
    for label, opts in (
        ('implementation="portable"', {"implementation": "portable"}),
        (f"chunk_size={args.chunk_size}", {"chunk_size": args.chunk_size}),
    ):
        path, base_path = plan(q, k, v, sinks=sinks, **opts).path, plan(q, k, v, **opts).path
        for what, fn, base in (
            ("forward", lambda o=opts: forward(o, sinks), lambda o=opts: forward(o, None)),
            ("forward + backward", lambda o=opts: train(o, True), lambda o=opts: train(o, False)),
        ):
            name = f"torch {label}, {what}"
            rows.append(
                compare(args, "sinks", name, (fn, path), ("no sinks", base, base_path), "overhead")
            )
    return rows


def _jax_sinks(args: argparse.Namespace, *arrays: np.ndarray) -> list[Row]:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        print("JAX is not installed: its sinks rows are left out", file=sys.stderr)
        return []
    time.sleep(0.3)
    q, k, v, sinks = (jnp.asarray(a) for a in arrays)
    path, base_path = f"{plan(q, k, v, sinks=sinks).path} (jit)", f"{plan(q, k, v).path} (jit)"
    fwd_with = jax.jit(lambda q, k, v, s: attend(q, k, v, sinks=s))
    fwd_without = jax.jit(lambda q, k, v: attend(q, k, v))
    grad_with = jax.jit(jax.grad(lambda *a: attend(*a[:3], sinks=a[3]).sum(), argnums=(0, 1, 2, 3)))
    grad_without = jax.jit(jax.grad(lambda *a: attend(*a).sum(), argnums=(0, 1, 2)))
    rows = []
    for name, fn, base in (
        ("JAX jit, forward", lambda: fwd_with(q, k, v, sinks), lambda: fwd_without(q, k, v)),
        ("JAX jit(grad)", lambda: grad_with(q, k, v, sinks), lambda: grad_without(q, k, v)),
    ):
        call = (lambda f=fn: jax.block_until_ready(f()), path)
        baseline = ("no sinks", lambda f=base: jax.block_until_ready(f()), base_path)
        rows.append(compare(args, "sinks", name, call, baseline, "overhead"))
    return rows


def flex_section(args: argparse.Namespace) -> list[Row]:
    """torch float32 calls that auto gives FlexAttention on the CPU (a sliding window,
    packed sequences with causal, an ALiBi score_mod with causal): auto against the
    portable path it took before (``implementation="portable"``: the blockwise path with
    block skipping), against FlexAttention compiled and called directly with a BlockMask
    built beforehand, and against SDPA's plain causal attention; forward, and forward +
    backward of ``sum(out)`` (on the CPU Flex has no backward: auto trains on the blockwise
    path, so the forward + backward rows compare it with the portable path and SDPA)."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        print("torch (with flex_attention) is not installed: the flex rows are left out")
        return []
    import torch.nn.functional as F

    length, heads = args.length, args.heads
    q, k, v = (torch.from_numpy(a) for a in _qkv(length, heads, args.dim))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    w, n = args.window, args.segments
    ids = torch.arange(length) * n // length  # n sequences of equal length
    slopes = torch.linspace(0.01, 0.2, heads)

    def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score - slopes[h] * (q_idx - kv_idx).to(score.dtype)

    def sliding(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w)

    def packed(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx >= kv_idx

    raw = torch.compile(flex_attention, dynamic=False)
    classes = (
        (f"window=({w - 1}, 0), causal", {"causal": True, "window": (w - 1, 0)}, sliding, None),
        (f"{n} packed sequences, causal", {"segment_ids": ids, "causal": True}, packed, None),
        ("ALiBi score_mod, causal", {"score_mod": alibi, "causal": True}, causal, alibi),
    )

    def forward(opts: dict[str, Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return attend(q, k, v, **opts)

        return run

    def train(opts: dict[str, Any]) -> Callable[[], None]:
        def run() -> None:
            for x in leaves:
                x.grad = None
            attend(*leaves, **opts).sum().backward()

        return run

    def sdpa_forward() -> Any:
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sdpa_train() -> None:
        for x in leaves:
            x.grad = None
        F.scaled_dot_product_attention(
            leaves[0], leaves[1], leaves[2], is_causal=True
        ).sum().backward()

    rows = []
    for name, opts, mask_mod, score_mod in classes:
        block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")

        def flex_direct(bm: Any = block_mask, sm: Any = score_mod) -> Any:
            with torch.no_grad():
                return raw(q, k, v, score_mod=sm, block_mask=bm)

        portable = {**opts, "implementation": "portable"}
        auto_path = plan(q, k, v, **opts).path
        auto_train = f"{auto_path} (trains: {_training_path(torch, leaves, opts)})"
        portable_path = plan(q, k, v, **portable).path
        for what, fn, base in (
            ("forward", forward(opts), ("portable", forward(portable), portable_path)),
            ("forward", forward(opts), ("Flex compiled, direct", flex_direct, "flex_attention")),
            ("forward", forward(opts), ("SDPA is_causal", sdpa_forward, "SDPA")),
            ("fwd+bwd", train(opts), ("portable", train(portable), portable_path)),
            ("fwd+bwd", train(opts), ("SDPA is_causal", sdpa_train, "SDPA")),
        ):
            path = auto_path if what == "forward" else auto_train
            rows.append(compare(args, "flex", f"{name}, {what}", (fn, path), base, "speed-up"))
    return rows


def _training_path(torch: Any, leaves: list[Any], opts: dict[str, Any]) -> str:
    """What auto runs where autograd needs gradients: on the CPU Flex has no backward."""
    from portable_attention.backends import torch_flex

    path = plan(*leaves, **opts).path
    if path == torch_flex.KERNEL.path and leaves[0].device.type == "cpu":
        return "portable:blockwise"
    return path


SECTIONS = {
    "mods": mods_section,
    "segments": segments_section,
    "sinks": sinks_section,
    "flex": flex_section,
}
TARGETS = {
    "mods": "block plan >= 5x",
    "segments": ">= 4x",
    "sinks": "<= 10%",
    "flex": "auto within 1.15x of Flex direct",
}


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


HEADER = ["section", "call", "path", "ms", "baseline", "baseline path", "baseline ms", "ratio"]


def print_header() -> None:
    print("| " + " | ".join(HEADER) + " |")
    print("| " + " | ".join("---:" if h.endswith("ms") else "---" for h in HEADER) + " |")
    sys.stdout.flush()


def print_row(r: Row) -> None:
    cells = [r.section, r.call, f"`{r.path}`", _ms(r.seconds), r.baseline]
    cells += [f"`{r.base_path}`", _ms(r.base_seconds), r.ratio]
    print("| " + " | ".join(cells) + " |")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192, help="L (queries = keys)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each (best of)")
    parser.add_argument("--window", type=int, default=128, help="keys each query sees")
    parser.add_argument("--segments", type=int, default=16, help="packed sequences")
    parser.add_argument("--chunk-size", type=int, default=512, help="torch's chunk_size row")
    parser.add_argument("--quick", action="store_true", help="L = 1024, 2 repeats")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS))
    args = parser.parse_args(argv)
    if args.quick:
        args.length, args.repeats = 1024, 2
    print(
        f"[1, {args.heads}, {args.length}, {args.dim}] float32, best of {args.repeats}; "
        f"targets: " + ", ".join(f"{s} {TARGETS[s]}" for s in args.only) + "\n"
    )
    print_header()
    for name in args.only:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
