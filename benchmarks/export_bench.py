"""ONNX export side by side: ``attend`` built into an ONNX model by ndonnx (symbolic batch
and length) against onnxruntime's own ``Attention`` operator (ONNX opset 23, one node),
both run by onnxruntime in one process on the same inputs.

    python benchmarks/export_bench.py [--length 1024] [--heads 8] [--dim 64]
                                      [--repeats 20] [--threads 1]

For each case where the two mean the same (causal with Lq == Lk: the operator's
``is_causal`` is upper-left aligned, ``attend``'s default lower-right, and the two agree
on square scores; a boolean mask, True = may attend, in both; grouped-query heads;
``softcap``), it prints the largest difference of each model from the float64 reference
(:func:`portable_attention.testing.reference_attention`), their largest difference from
each other, and the median time of one run of each model over ``--repeats`` runs after
one warm-up, the two models' runs alternating. Shapes: q ``[1, heads, L, dim]``, k and v
``[1, kv_heads, L, dim]``, float32. Nothing here asserts: it prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ndonnx as ndx
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from portable_attention import attend
from portable_attention.testing import reference_attention

#: name -> (attend's options, kv heads as a divisor of the query heads, a boolean mask?)
CASES: dict[str, tuple[dict[str, Any], int, bool]] = {
    "causal": ({"causal": True}, 1, False),
    "causal, GQA (Hk = H/4)": ({"causal": True}, 4, False),
    "mask (70% kept)": ({}, 1, True),
    "causal + mask, GQA": ({"causal": True}, 4, True),
    "softcap 30 + causal": ({"causal": True, "softcap": 30.0}, 1, False),
}


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def ndonnx_model(options: dict[str, Any], hq: int, hk: int, d: int, masked: bool) -> Any:
    """``attend`` on ndonnx arguments of symbolic batch ``B`` and length ``L``."""
    q = ndx.argument(shape=("B", hq, "L", d), dtype=ndx.float32)
    k = ndx.argument(shape=("B", hk, "L", d), dtype=ndx.float32)
    v = ndx.argument(shape=("B", hk, "L", d), dtype=ndx.float32)
    inputs = {"q": q, "k": k, "v": v}
    given = dict(options)
    if masked:
        inputs["mask"] = given["mask"] = ndx.argument(shape=("B", 1, "L", "L"), dtype=ndx.bool)
    return ndx.build(inputs, {"out": attend(q, k, v, **given)})


def attention_op_model(options: dict[str, Any], hq: int, hk: int, d: int, masked: bool) -> Any:
    """onnxruntime's ``Attention`` (opset 23): one node, the same symbolic dims."""
    names = ["q", "k", "v"]
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", h, "L", d])
        for n, h in (("q", hq), ("k", hk), ("v", hk))
    ]
    if masked:
        names.append("mask")
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, ["B", 1, "L", "L"]))
    attributes: dict[str, Any] = {"q_num_heads": hq, "kv_num_heads": hk}
    if options.get("causal"):
        attributes["is_causal"] = 1
    if options.get("softcap"):
        attributes["softcap"] = float(options["softcap"])
    node = helper.make_node("Attention", names, ["out"], **attributes)
    output = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", hq, "L", d])
    graph = helper.make_graph([node], "attention", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    onnx.checker.check_model(model)
    return model


def median_ms(run: Any, feeds: dict[str, np.ndarray], times: list[float]) -> None:
    start = time.perf_counter()
    run.run(None, feeds)
    times.append((time.perf_counter() - start) * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="onnxruntime's intra-op threads")
    args = p.parse_args()
    length, hq, d = args.length, args.heads, args.dim
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, ndonnx {ndx.__version__}")
    print(f"q [1, {hq}, {length}, {d}] float32; {args.threads} intra-op thread(s); medians of ")
    print(f"{args.repeats} runs after one warm-up, the two models alternating\n")
    print(
        "| case | k, v | ours vs float64 | Attention op vs float64 | ours vs op "
        "| ours (ms) | Attention op (ms) | ours / op |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rng = np.random.default_rng(0)
    for name, (options, divisor, masked) in CASES.items():
        hk = hq // divisor
        feeds = {
            "q": rng.standard_normal((1, hq, length, d), dtype=np.float32),
            "k": rng.standard_normal((1, hk, length, d), dtype=np.float32),
            "v": rng.standard_normal((1, hk, length, d), dtype=np.float32),
        }
        if masked:
            feeds["mask"] = rng.random((1, 1, length, length)) < 0.7
        ours = session(ndonnx_model(options, hq, hk, d, masked), args.threads)
        op = session(attention_op_model(options, hq, hk, d, masked), args.threads)
        got_ours, got_op = ours.run(None, feeds)[0], op.run(None, feeds)[0]  # warm-up
        want = reference_attention(**feeds, **options).out
        ours_ms: list[float] = []
        op_ms: list[float] = []
        for _ in range(args.repeats):
            median_ms(ours, feeds, ours_ms)
            median_ms(op, feeds, op_ms)
        a, b = statistics.median(ours_ms), statistics.median(op_ms)
        print(
            f"| {name} | [1, {hk}, {length}, {d}] | {np.abs(got_ours - want).max():.1e} "
            f"| {np.abs(got_op - want).max():.1e} | {np.abs(got_ours - got_op).max():.1e} "
            f"| {a:.2f} | {b:.2f} | {a / b:.2f} |"
        )


if __name__ == "__main__":
    main()
