"""Benchmark of portable_attention.parallel: ring and Ulysses against one device.

    python benchmarks/parallel_bench.py            # everything (a few minutes on 2 cores)
    python benchmarks/parallel_bench.py --only schedule jax target torch

Prints, in one run:

- ``schedule``: the causal load balance of the ring's schedule (the sum over steps of
  the busiest shard's kept scores over the sum of the mean; 1.0 is perfect), for both
  layouts, with the K/V transfers per forward pass.
- ``packing``: 16 packed documents of random lengths in L = 65,536 over 8 shards, causal
  document mask: per layout (contiguous, zigzag, document_zigzag), the largest shard's
  kept scores and kept score blocks (512 and 128 square) over the mean.
- ``jax``: 8 simulated JAX devices (``--xla_force_host_platform_device_count=8``, set
  here before JAX is imported): forward and forward+backward time of each method and
  layout against ``jax.jit`` of single-device ``attend`` on the same arrays (the same
  total work), and each one's compiled temporaries per device (``memory_analysis()``);
  the packed rows: 16 documents as ``segment_ids``, against ``attend(segment_ids=...)``
  on one device and the causal ring without ids (every block computed).
- ``target``: ``[1, 1, 65536, 64]`` float32 causal on the 8 devices, forward and
  backward: compile time, run time and temporaries per device (target: < 256 MiB).
- ``torch``: 4 gloo ranks on 127.0.0.1 (one thread each): forward and forward+backward
  time per step (the slowest rank's) against single-process ``attend`` on the whole
  sequence, and each rank's peak RSS against the single process's; the packed rows run
  16 documents (``segment_ids``) in each layout, against ``attend(segment_ids=...)`` in
  one process and the causal ring without ids (every block computed).

The simulated devices share this machine's cores: a ratio is the cost of the sharded
program with its collectives on the same CPUs, not a speed-up (that needs real devices).
Times are medians of ``--repeat`` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MiB = 1 << 20


def _rss_mib(field: str = "VmHWM") -> float:
    """This process's peak (``VmHWM``) or current (``VmRSS``) resident memory in MiB
    (``ru_maxrss`` would carry the parent's peak over the fork of a spawned process)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _median_time(fn: Any, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    print(f"\n## {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    sys.stdout.flush()


def schedule_section(length: int) -> None:
    from portable_attention import parallel

    rows = []
    for shards in (2, 4, 8):
        for window in (None, (length // 16, 0)):
            for layout in ("zigzag", "contiguous"):
                plan = parallel.schedule(shards, layout, length, causal=True, window=window)
                work = plan.work()
                busiest = max(max(step) for step in work)
                rows.append(
                    [
                        shards,
                        layout,
                        "causal" if window is None else f"causal, window {window[0]}",
                        f"{plan.balance():.3f}",
                        f"{busiest / (length / shards) ** 2:.2f}",
                        len(plan.steps),
                        plan.transfers,
                    ]
                )
    _table(
        f"Ring schedule, L = {length}: load balance (max/mean kept scores per step)",
        ["P", "layout", "mask", "max/mean", "busiest step / (L/P)^2", "steps", "K/V transfers"],
        rows,
    )


def _packing(length: int, documents: int, unit: int, seed: int = 0) -> Any:
    """Segment ids of ``documents`` packed documents of random lengths (multiples of
    ``unit``, so that the per-document zigzag layout can cut them) filling ``length``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, length // unit), documents - 1, replace=False))
    sizes = np.diff(np.concatenate([[0], cuts, [length // unit]])) * unit
    return np.repeat(np.arange(documents), sizes)


def _shard_rows(ids: Any, shards: int, layout: str) -> list[Any]:
    """Each shard's natural positions in the order its ring computes them (the
    per-document layout: its two halves, as ``ring_attend`` regroups them)."""
    import numpy as np

    from portable_attention import parallel
    from portable_attention.parallel import _documents

    documents = {"segment_ids": ids} if layout == "document_zigzag" else {}
    natural = np.arange(ids.shape[-1])
    rows = np.split(parallel.reorder(natural, shards, layout, axis=-1, **documents), shards)
    if layout == "document_zigzag":
        rows = [r[_documents.halves(np, ids[r])] for r in rows]
    return rows


def packing_section(length: int, documents: int, shards: int, block: int) -> None:
    """The causal document mask's work per shard for each layout: kept scores and kept
    ``block x block`` score blocks (a block with no kept score is skipped), the largest
    shard's over the mean, and the blocks kept against the ring without skipping."""
    import numpy as np

    ids = _packing(length, documents, 2 * shards)
    start = np.searchsorted(ids, ids, side="left")  # each position's document start
    rows = []
    for layout in ("contiguous", "zigzag", "document_zigzag"):
        scores, blocks = [], []
        shard_rows = _shard_rows(ids, shards, layout)
        key_blocks = [pos[i : i + block] for pos in shard_rows for i in range(0, pos.size, block)]
        spans = [{d: (p[ids[p] == d].min()) for d in np.unique(ids[p])} for p in key_blocks]
        for pos in shard_rows:
            scores.append(int(np.sum(pos - start[pos] + 1)))
            kept = 0
            for i in range(0, pos.size, block):
                qb = pos[i : i + block]
                last = {d: qb[ids[qb] == d].max() for d in np.unique(ids[qb])}
                kept += sum(any(d in last and first <= last[d] for d, first in span.items())
                            for span in spans)  # fmt: skip
            blocks.append(kept)
        total = (length // block) ** 2
        rows.append(
            [
                layout,
                f"{max(scores) / np.mean(scores):.3f}",
                f"{max(blocks) / np.mean(blocks):.3f}",
                max(blocks),
                f"{sum(blocks)} / {total} ({sum(blocks) / total:.1%})",
            ]
        )
    sizes = np.bincount(ids)
    _table(
        f"Packed causal documents over {shards} shards: {documents} documents of random lengths "
        f"(multiples of {2 * shards}, {sizes.min()} to {sizes.max()}) in L = {length}, "
        f"{block} x {block} blocks",
        [
            "layout",
            "kept scores max/mean",
            "kept blocks max/mean",
            "busiest shard's blocks",
            "blocks kept / all",
        ],
        rows,
    )


def _jax_arrays(shape: tuple[int, ...], mesh: Any) -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    key = jax.random.key(0)
    arrays = [jax.random.normal(k, shape, jnp.float32) for k in jax.random.split(key, 4)]
    seq = NamedSharding(mesh, P(None, None, "s", None))
    return arrays, [jax.device_put(x, seq) for x in arrays]


def _jax_programs(fn: Any) -> tuple[Any, Any]:
    import jax

    def both(q: Any, k: Any, v: Any, dout: Any) -> Any:
        out, pull = jax.vjp(fn, q, k, v)
        return out, pull(dout)

    return jax.jit(fn), jax.jit(both)


def jax_section(length: int, heads: int, repeat: int) -> None:
    import jax

    import portable_attention as pa
    from portable_attention import parallel

    mesh = jax.make_mesh((8,), ("s",))
    shape = (1, heads, length, 64)
    plain, sharded = _jax_arrays(shape, mesh)
    methods: list[tuple[str, Any, list[Any]]] = [
        ("attend, 1 device", lambda q, k, v: pa.attend(q, k, v, causal=True), plain),
    ]
    for method, layout in (("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "contiguous")):
        methods.append(
            (
                f"{method} {layout}, 8 devices",
                lambda q, k, v, m=method, lo=layout: parallel.sharded_attend(
                    q, k, v, mesh=mesh, axis="s", method=m, layout=lo, causal=True
                ),
                sharded,
            )
        )
    # Packed: 16 documents of random lengths, as segment ids (the ring skips, with a
    # lax.cond on each device, the blocks where no query shares a document with a key).
    ids = jax.numpy.asarray(_packing(length, 16, 16))
    methods.append(
        (
            "attend(segment_ids), 1 device",
            lambda q, k, v: pa.attend(q, k, v, causal=True, segment_ids=ids),
            plain,
        )
    )
    for layout in ("zigzag", "contiguous"):
        methods.append(
            (
                f"ring {layout} packed, 8 devices",
                lambda q, k, v, lo=layout: parallel.sharded_attend(
                    q, k, v, mesh=mesh, axis="s", layout=lo, causal=True, segment_ids=ids
                ),
                sharded,
            )
        )
    rows, base = [], {}
    for name, fn, arrays in methods:
        forward, both = _jax_programs(fn)
        cells = [name]
        for label, program, args in (("fwd", forward, arrays[:3]), ("fwd+bwd", both, arrays)):
            start = time.perf_counter()
            compiled = program.lower(*args).compile()
            compile_s = time.perf_counter() - start
            temps = compiled.memory_analysis().temp_size_in_bytes / MiB
            seconds = _median_time(lambda c=compiled, a=args: jax.block_until_ready(c(*a)), repeat)
            base.setdefault(label, seconds)
            cells += [
                f"{seconds * 1e3:.0f}",
                f"{seconds / base[label]:.2f}x",
                f"{temps:.1f}",
                f"{compile_s:.1f}",
            ]
        rows.append(cells)
    _table(
        f"JAX, q,k,v {list(shape)} float32 causal, 8 simulated devices on {os.cpu_count()} "
        "cores; packed: 16 documents of random lengths (ratios against causal attend without "
        "ids)",
        [
            "method",
            "fwd ms",
            "vs 1 device",
            "fwd temp MiB/device",
            "compile s",
            "fwd+bwd ms",
            "vs 1 device",
            "fwd+bwd temp MiB/device",
            "compile s",
        ],
        rows,
    )


def target_section() -> None:
    import jax

    from portable_attention import parallel

    mesh = jax.make_mesh((8,), ("s",))
    shape = (1, 1, 65536, 64)
    _, arrays = _jax_arrays(shape, mesh)
    ring = lambda q, k, v: parallel.sharded_attend(q, k, v, mesh=mesh, axis="s", causal=True)  # noqa: E731
    _, both = _jax_programs(ring)
    start = time.perf_counter()
    compiled = both.lower(*arrays).compile()
    compile_s = time.perf_counter() - start
    temps = compiled.memory_analysis().temp_size_in_bytes / MiB
    start = time.perf_counter()
    out, grads = compiled(*arrays)
    jax.block_until_ready((out, grads))
    run_s = time.perf_counter() - start
    finite = all(bool(jax.numpy.isfinite(g).all()) for g in grads)
    _table(
        f"Target: {list(shape)} float32 causal, ring zigzag on 8 simulated devices, fwd+bwd",
        ["compile s", "run s", "temporaries MiB/device", "target", "gradients finite"],
        [[f"{compile_s:.1f}", f"{run_s:.1f}", f"{temps:.1f}", "< 256", finite]],
    )


# -- torch.distributed ----------------------------------------------------------------------


def _torch_rank(
    rank: int, world: int, port: int, method: str, setting: tuple[int, int, int], out: Any
) -> None:
    """One rank of one method (a fresh process each, so its peak RSS is that method's)."""
    import torch
    import torch.distributed as dist

    from portable_attention import parallel

    length, heads, repeat = setting
    name, layout, *packed = method.split()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.as_tensor(_packing(length, 16, 2 * world))
    documents = {"segment_ids": ids} if layout == "document_zigzag" else {}

    def shard(x: Any, axis: int = -2) -> Any:
        moved = parallel.reorder(x, world, layout, axis=axis, **documents)
        return moved.chunk(world, dim=axis)[rank].contiguous()

    local = [shard(torch.randn(1, heads, length, 64, generator=gen)) for _ in range(4)]
    options: dict[str, Any] = {"causal": True, "layout": layout}
    if packed:
        options["segment_ids"] = shard(ids, axis=-1)
    setup = _rss_mib("VmRSS")  # torch, gloo and this rank's inputs
    fn = parallel.ring_attend if name == "ring" else parallel.ulysses_attend

    def forward() -> None:
        with torch.no_grad():
            fn(*local[:3], **options)
        dist.barrier()

    def both() -> None:
        args = [x.clone().requires_grad_() for x in local[:3]]
        o = fn(*args, **options)
        torch.autograd.grad(o, args, local[3])
        dist.barrier()

    times = (_median_time(forward, repeat), _median_time(both, repeat))
    out.put((times, (_rss_mib(), _rss_mib() - setup)))
    dist.destroy_process_group()


def _torch_single(length: int, heads: int, repeat: int, packed: bool, out: Any) -> None:
    import torch

    import portable_attention as pa

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, length, 64, generator=gen) for _ in range(4))
    options: dict[str, Any] = {"causal": True}
    if packed:  # the ranks' packing (documents in multiples of 2 * 4 ranks)
        options["segment_ids"] = torch.as_tensor(_packing(length, 16, 8))
    setup = _rss_mib("VmRSS")

    def forward() -> None:
        with torch.no_grad():
            pa.attend(q, k, v, **options)

    def both() -> None:
        args = [x.clone().requires_grad_() for x in (q, k, v)]
        torch.autograd.grad(pa.attend(*args, **options), args, dout)

    times = (_median_time(forward, repeat), _median_time(both, repeat))
    out.put((times, (_rss_mib(), _rss_mib() - setup), torch.get_num_threads()))


def torch_section(length: int, heads: int, repeat: int, world: int = 4) -> None:
    import socket

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    singles = {}
    for packed in (False, True):
        single = ctx.Process(target=_torch_single, args=(length, heads, repeat, packed, queue))
        single.start()
        singles[packed] = queue.get()
        single.join()
    (fwd1, both1), peak1, threads = singles[False]
    runs = {}
    methods = ["ring zigzag", "ring contiguous", "ulysses contiguous"]
    methods += [f"ring {layout} packed" for layout in ("contiguous", "zigzag", "document_zigzag")]
    for method in methods:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        setting = (length, heads, repeat)
        procs = [
            ctx.Process(target=_torch_rank, args=(r, world, port, method, setting, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        runs[method] = [queue.get() for _ in procs]
        for p in procs:
            p.join()
    rows = [
        [
            "attend, 1 process",
            f"{fwd1 * 1e3:.0f}",
            "1.00x",
            f"{both1 * 1e3:.0f}",
            "1.00x",
            f"{peak1[0]:.0f}",
            f"{peak1[1]:.0f}",
        ]
    ]
    (fwd_p, both_p), peak_p, _ = singles[True]
    rows.append(
        [
            "attend(segment_ids), 1 process",
            f"{fwd_p * 1e3:.0f}",
            f"{fwd_p / fwd1:.2f}x",
            f"{both_p * 1e3:.0f}",
            f"{both_p / both1:.2f}x",
            f"{peak_p[0]:.0f}",
            f"{peak_p[1]:.0f}",
        ]
    )
    for name, seen in runs.items():
        fwd = max(r[0][0] for r in seen)
        both = max(r[0][1] for r in seen)
        peak = max(r[1][0] for r in seen)
        grown = max(r[1][1] for r in seen)
        rows.append(
            [
                f"{name}, {world} ranks",
                f"{fwd * 1e3:.0f}",
                f"{fwd / fwd1:.2f}x",
                f"{both * 1e3:.0f}",
                f"{both / both1:.2f}x",
                f"{peak:.0f}",
                f"{grown:.0f}",
            ]
        )
    _table(
        f"torch, q,k,v [1, {heads}, {length}, 64] float32 causal: {world} gloo ranks of 1 thread "
        f"against 1 process of {threads} threads, on {os.cpu_count()} cores; packed: 16 "
        "documents of random lengths (ratios against causal attend without ids)",
        [
            "method",
            "fwd ms",
            "vs 1 process",
            "fwd+bwd ms",
            "vs 1 process",
            "peak RSS MiB (max rank)",
            "peak - RSS after setup MiB",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only", nargs="*", default=["schedule", "packing", "jax", "target", "torch"]
    )
    parser.add_argument("--length", type=int, default=8192, help="JAX sequence length")
    parser.add_argument("--torch-length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if "schedule" in args.only:
        schedule_section(args.length)
    if "packing" in args.only:
        for block in (512, 128):
            packing_section(65536, 16, 8, block)
    if "jax" in args.only:
        jax_section(args.length, args.heads, args.repeat)
    if "target" in args.only:
        target_section()
    if "torch" in args.only:
        torch_section(args.torch_length, args.heads, args.repeat)


if __name__ == "__main__":
    main()
