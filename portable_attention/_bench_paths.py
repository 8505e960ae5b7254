"""``python -m portable_attention bench --fast-paths``: torch's call classes that SDPA cannot
take whole (a sliding window, packed sequences, a score_mod), each forward and forward +
backward at long context, on every path of the package that runs the call, against SDPA
causal (unmasked: the cost of full causal attention) and FlexAttention compiled directly
with the same block mask, in the same run.

For each row: ``auto``'s path (``plan()``), its time, the fastest of the package's paths
and the ratio of auto to it (<= 1.10 is the target), and auto against each anchor
(``anchor time / auto time``: >= 1, auto is at least as fast). Times are medians of calls
timed one by one after a warm-up call (which compiles Flex); float32 ``[1, 8, L, 64]``.
FlexAttention has no CPU backward in torch 2.13: its forward + backward cells say so.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

#: Sequence lengths of the rows (the test makes them small).
LENGTHS = (4096, 8192)
#: Documents of the packed rows, of equal length.
DOCUMENTS = 8
WINDOW = 255
#: The package's paths tried for each call (``implementation=``/``chunk_size=``).
PATHS: dict[str, dict[str, Any]] = {
    "auto": {},
    "portable": {"implementation": "portable"},
    "chunk_size=128": {"chunk_size": 128},
    "fused": {"implementation": "fused"},
}


def _alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """An ALiBi-like score_mod: a linear penalty with the distance, one slope per head."""
    return score - (h + 1) * 0.01 * (q_idx - kv_idx)


def _classes(torch: Any, length: int) -> dict[str, tuple[dict[str, Any], Callable[..., Any]]]:
    """Call class -> (attend's options, Flex's mask_mod) at ``length``."""
    doc = torch.arange(length) // (length // DOCUMENTS)

    def window(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (q >= kv) & (q - kv <= WINDOW)

    def packed(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (doc[q] == doc[kv]) & (q >= kv)

    def causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return q >= kv

    return {
        f"window ({WINDOW}, 0)": ({"causal": True, "window": (WINDOW, 0)}, window),
        f"packed, {DOCUMENTS} documents": ({"causal": True, "segment_ids": doc[None]}, packed),
        "score_mod (ALiBi), causal": ({"causal": True, "score_mod": _alibi}, causal),
    }


def _median_ms(fn: Callable[[], Any], budget: float) -> float:
    fn()  # warm-up (compiles)
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _step(fn: Callable[..., Any], qkv: tuple[Any, ...], backward: bool) -> Callable[[], Any]:
    if not backward:
        return lambda: fn(*qkv)

    def run() -> None:
        for x in qkv:
            x.grad = None
        fn(*qkv).sum().backward()

    return run


def rows(budget: float = 1.0) -> list[dict[str, Any]]:
    """The rows (see the module), measured now."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from portable_attention import attend, plan

    flex = torch.compile(flex_attention, dynamic=False)
    out: list[dict[str, Any]] = []
    for length in LENGTHS:
        gen = torch.Generator().manual_seed(length)
        qkv = tuple(torch.randn(1, 8, length, 64, generator=gen) for _ in range(3))
        for name, (options, mask_mod) in _classes(torch, length).items():
            score_mod = options.get("score_mod")
            block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")
            for backward in (False, True):
                args = tuple(x.detach().requires_grad_(backward) for x in qkv)
                print(
                    f"  L={length} {name}, {'fwd+bwd' if backward else 'fwd'} ...", file=sys.stderr
                )
                ours: dict[str, tuple[str, float]] = {}
                for label, extra in PATHS.items():
                    call = _step(
                        lambda q, k, v, e=extra, o=options: attend(q, k, v, **o, **e),
                        args,
                        backward,
                    )
                    try:  # fused: no kernel for the call (or none with a CPU backward)
                        path = plan(args[0], args[1], args[2], **options, **extra).path
                        ours[label] = (path, _median_ms(call, budget))
                    except (TypeError, ValueError) as err:
                        ours[label] = (f"n/a: {str(err)[:60]}", float("nan"))
                sdpa = _step(
                    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    args,
                    backward,
                )
                anchors = {"SDPA causal": _median_ms(sdpa, budget)}
                if backward:
                    anchors["Flex compiled"] = float("nan")  # no CPU backward in torch 2.13
                else:

                    def direct(
                        q: Any, k: Any, v: Any, s: Any = score_mod, m: Any = block_mask
                    ) -> Any:
                        return flex(q, k, v, score_mod=s, block_mask=m)

                    anchors["Flex compiled"] = _median_ms(_step(direct, args, False), budget)
                timed = {k: v for k, v in ours.items() if v[1] == v[1]}
                best = min(timed, key=lambda k: timed[k][1])
                out.append(
                    {
                        "length": length,
                        "call": name,
                        "pass": "fwd+bwd" if backward else "fwd",
                        "paths": {k: {"path": p, "ms": t} for k, (p, t) in ours.items()},
                        "auto_path": ours["auto"][0],
                        "auto_ms": ours["auto"][1],
                        "best": best,
                        "best_ms": timed[best][1],
                        "anchors_ms": anchors,
                    }
                )
    return out


def print_rows(table: list[dict[str, Any]]) -> None:
    print(
        f"{'L':>5} {'call':<28} {'pass':<7} {'auto path':<20} {'auto ms':>9} "
        f"{'fastest of ours':<16} {'auto/fastest':>12} {'SDPA causal/auto':>16} "
        f"{'Flex/auto':>9}"
    )
    for r in table:
        sdpa, flex = r["anchors_ms"]["SDPA causal"], r["anchors_ms"]["Flex compiled"]
        print(
            f"{r['length']:>5} {r['call']:<28} {r['pass']:<7} {r['auto_path']:<20} "
            f"{r['auto_ms']:>9.1f} {r['best']:<16} {r['auto_ms'] / r['best_ms']:>12.2f} "
            f"{sdpa / r['auto_ms']:>16.2f} "
            + (f"{flex / r['auto_ms']:>9.2f}" if flex == flex else f"{'n/a':>9}")
        )
    print(
        "auto/fastest: auto's time over the fastest path of the package for the call (target "
        "<= 1.10); SDPA causal/auto, Flex/auto: the anchor's time over auto's (>= 1: auto "
        "is at least as fast); Flex has no CPU backward in torch 2.13"
    )
