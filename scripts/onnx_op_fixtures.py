#!/usr/bin/env python3
"""Writes small hand-built ONNX models that exercise importer paths the
PyTorch exports do not: a decomposed LayerNorm (ReduceMean/Sub/Pow/Sqrt/Div)
and an Erf GELU, Gather along inner axes with index arrays, Softmax over a
middle axis, ReduceSum with axes as an input, MatMul with a 1-D operand,
depthwise Conv with auto_pad SAME_UPPER, AveragePool counting padding,
MaxPool in ceil mode (where it fits), Clip, and Gemm with alpha/beta.
References come from onnxruntime at batch 2.

    OUT/ops_*.onnx  OUT/ops_*.<input>.npy  OUT/ops_*.<output>.npy

Needs onnx, onnxruntime and numpy:
    python3 scripts/onnx_op_fixtures.py tests/data/onnx
"""
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

rng = np.random.default_rng(0)


def const(name, arr):
    return helper.make_node("Constant", [], [name], name=name + "_const",
                            value=numpy_helper.from_array(np.asarray(arr), name))


def layernorm_model():
    f = TensorProto.FLOAT
    x = helper.make_tensor_value_info("x", f, ["batch", 4, 8])
    outs = [helper.make_tensor_value_info(n, f, s) for n, s in (
        ("soft", ["batch", 8, 3]), ("picked", ["batch", 4, 2, 2]), ("summed", ["batch", 8]),
        ("dotted", ["batch", 4]))]
    gamma = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "gamma")
    beta = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "beta")
    w = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "w")
    n = helper.make_node
    nodes = [
        n("ReduceMean", ["x"], ["mean"], name="ln_mean", axes=[-1], keepdims=1),
        n("Sub", ["x", "mean"], ["d"], name="ln_sub"),
        const("two", np.float32(2.0)),
        n("Pow", ["d", "two"], ["d2"], name="ln_pow"),
        n("ReduceMean", ["d2"], ["var"], name="ln_var", axes=[-1], keepdims=1),
        const("eps", np.float32(1e-5)),
        n("Add", ["var", "eps"], ["ve"], name="ln_add_eps"),
        n("Sqrt", ["ve"], ["std"], name="ln_sqrt"),
        n("Div", ["d", "std"], ["norm"], name="ln_div"),
        n("Mul", ["norm", "gamma"], ["scaled"], name="ln_gamma"),
        n("Add", ["scaled", "beta"], ["ln"], name="ln_beta"),
        const("sqrt2", np.float32(np.sqrt(2.0))),
        n("Div", ["ln", "sqrt2"], ["g0"], name="gelu_div"),
        n("Erf", ["g0"], ["g1"], name="gelu_erf"),
        const("one", np.float32(1.0)),
        n("Add", ["g1", "one"], ["g2"], name="gelu_add"),
        n("Mul", ["ln", "g2"], ["g3"], name="gelu_mul"),
        const("half", np.float32(0.5)),
        n("Mul", ["g3", "half"], ["h"], name="gelu_half"),
        const("rows", np.array([2, 0, 3], dtype=np.int64)),
        n("Gather", ["h", "rows"], ["g"], name="gather_axis1", axis=1),
        n("Transpose", ["g"], ["gt"], name="transpose", perm=[0, 2, 1]),
        n("Softmax", ["gt"], ["soft"], name="softmax_mid", axis=1),
        const("cols", np.array([[7, 1], [0, 0]], dtype=np.int64)),
        n("Gather", ["h", "cols"], ["gc"], name="gather_axis2", axis=2),
        n("Sigmoid", ["gc"], ["picked"], name="sigmoid"),
        const("axes", np.array([1], dtype=np.int64)),
        n("ReduceSum", ["h", "axes"], ["summed"], name="reduce_sum", keepdims=0),
        n("MatMul", ["h", "w"], ["dotted"], name="matvec"),
    ]
    g = helper.make_graph(nodes, "ops_layernorm", [x], outs, initializer=[gamma, beta, w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnx_op_fixtures"), {
        "x": rng.standard_normal((2, 4, 8)).astype(np.float32)}


def conv_model():
    f = TensorProto.FLOAT
    x = helper.make_tensor_value_info("x", f, ["batch", 4, 9, 9])
    y = helper.make_tensor_value_info("y", f, ["batch", 6])
    w = numpy_helper.from_array(rng.standard_normal((4, 1, 3, 3)).astype(np.float32), "dw")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "db")
    fc = numpy_helper.from_array(rng.standard_normal((16, 6)).astype(np.float32), "fc")
    fcb = numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "fcb")
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "dw", "db"], ["c"], name="depthwise", group=4, kernel_shape=[3, 3],
          strides=[2, 2], auto_pad="SAME_UPPER"),
        n("AveragePool", ["c"], ["a"], name="avg_pad", kernel_shape=[3, 3], pads=[1, 1, 1, 1],
          count_include_pad=1),
        n("MaxPool", ["a"], ["m"], name="max_ceil", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
        const("lo", np.float32(-0.5)),
        const("hi", np.float32(0.5)),
        n("Clip", ["m", "lo", "hi"], ["cl"], name="clip"),
        n("Flatten", ["cl"], ["fl"], name="flatten", axis=1),
        n("Gemm", ["fl", "fc", "fcb"], ["y"], name="gemm", alpha=0.5, beta=2.0),
    ]
    g = helper.make_graph(nodes, "ops_conv", [x], [y], initializer=[w, b, fc, fcb])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnx_op_fixtures"), {
        "x": rng.standard_normal((2, 4, 9, 9)).astype(np.float32)}


def main(out):
    os.makedirs(out, exist_ok=True)
    for name, build in (("ops_layernorm", layernorm_model), ("ops_conv", conv_model)):
        model, feeds = build()
        model.ir_version = 8
        onnx.checker.check_model(model)
        onnx.save(model, os.path.join(out, name + ".onnx"))
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        results = sess.run(None, feeds)
        for k, v in feeds.items():
            np.save(os.path.join(out, f"{name}.{k}.npy"), v)
        for o, v in zip(sess.get_outputs(), results):
            np.save(os.path.join(out, f"{name}.{o.name}.npy"), v)
            print(name, o.name, v.shape)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/onnx")
