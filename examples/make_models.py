"""Generate the example ONNX models (small, deterministic weights) into this directory.

    python examples/make_models.py          # writes mlp.onnx, transformer_block.onnx,
                                             # detection_postprocess.onnx

* ``mlp.onnx``: a 3-layer perceptron (Gemm + Relu, Gemm + Relu, Gemm + Softmax) over a
  ``[batch, 256]`` input; ``batch`` is symbolic (``polyhal run --dim batch=N``; default 1).
* ``transformer_block.onnx``: one pre-softmax-scaled multi-head self-attention encoder block
  (4 heads, d_model 128, d_ff 512, GELU, post-LayerNorm) over ``[batch, seq, 128]``.
* ``detection_postprocess.onnx``: SSD-style post-processing: the best class score per box,
  TopK of those, then NonMaxSuppression over the top boxes; outputs the selected indices
  (their count depends on the data) and the top scores.

Weights come from a fixed seed, so regenerating gives identical files.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
OPSET = 20  # Gelu joined the default domain in opset 20
F = TensorProto.FLOAT


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def _model(graph: onnx.GraphProto, doc: str) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="polyhal-examples")
    model.ir_version = 9  # readable by onnxruntime releases of the last two years
    model.doc_string = doc
    onnx.checker.check_model(model, full_check=True)
    return model


def mlp(rng: np.random.Generator, d_in: int = 256, hidden: int = 256, classes: int = 16) -> onnx.ModelProto:
    dims = [d_in, hidden, hidden, classes]
    nodes, inits = [], []
    x = "x"
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        w = (rng.standard_normal((b, a)) / math.sqrt(a)).astype(np.float32)  # [out, in], as PyTorch exports
        inits += [_init(f"fc{i}.weight", w), _init(f"fc{i}.bias", rng.standard_normal(b).astype(np.float32) * 0.1)]
        y = f"fc{i}"
        nodes.append(helper.make_node("Gemm", [x, f"fc{i}.weight", f"fc{i}.bias"], [y], name=f"fc{i}", transB=1))
        x = y
        if i < len(dims) - 2:
            nodes.append(helper.make_node("Relu", [x], [f"relu{i}"], name=f"relu{i}"))
            x = f"relu{i}"
    nodes.append(helper.make_node("Softmax", [x], ["probs"], name="softmax", axis=-1))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", F, ["batch", d_in])],
                              [helper.make_tensor_value_info("probs", F, ["batch", classes])], inits)
    return _model(graph, "3-layer MLP classifier (examples/make_models.py)")


def transformer_block(rng: np.random.Generator, d: int = 128, heads: int = 4, d_ff: int = 512) -> onnx.ModelProto:
    dh = d // heads
    nodes, inits = [], []

    def linear(x: str, name: str, a: int, b: int) -> str:
        inits.append(_init(f"{name}.weight", (rng.standard_normal((a, b)) / math.sqrt(a)).astype(np.float32)))
        inits.append(_init(f"{name}.bias", (rng.standard_normal(b) * 0.02).astype(np.float32)))
        nodes.append(helper.make_node("MatMul", [x, f"{name}.weight"], [f"{name}.mm"], name=f"{name}.matmul"))
        nodes.append(helper.make_node("Add", [f"{name}.mm", f"{name}.bias"], [name], name=f"{name}.add"))
        return name

    def node(op: str, ins: list[str], out: str, **attrs) -> str:
        nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        return out

    # Shapes are read from the input (Shape -> Gather -> Concat), as exporters write them, so
    # batch and seq stay symbolic; polyhal folds all of it once the input shape is known.
    inits += [_init("heads_dims", np.array([heads, dh], np.int64)), _init("zero", np.array([0], np.int64)),
              _init("one", np.array([1], np.int64)), _init("d_model", np.array([d], np.int64)),
              _init("scale", np.array(1.0 / math.sqrt(dh), np.float32))]
    node("Shape", ["x"], "x_shape")
    node("Gather", ["x_shape", "zero"], "batch")
    node("Gather", ["x_shape", "one"], "seq")
    node("Concat", ["batch", "seq", "heads_dims"], "split_shape", axis=0)
    node("Concat", ["batch", "seq", "d_model"], "merge_shape", axis=0)
    q = linear("x", "q", d, d)
    k = linear("x", "k", d, d)
    v = linear("x", "v", d, d)
    qh = node("Transpose", [node("Reshape", [q, "split_shape"], "q_heads")], "q_t", perm=[0, 2, 1, 3])
    kh = node("Transpose", [node("Reshape", [k, "split_shape"], "k_heads")], "k_t", perm=[0, 2, 3, 1])
    vh = node("Transpose", [node("Reshape", [v, "split_shape"], "v_heads")], "v_t", perm=[0, 2, 1, 3])
    scores = node("Mul", [node("MatMul", [qh, kh], "scores_raw"), "scale"], "scores")
    attn = node("Softmax", [scores], "attn", axis=-1)
    ctx = node("Transpose", [node("MatMul", [attn, vh], "ctx_heads")], "ctx_t", perm=[0, 2, 1, 3])
    ctx = node("Reshape", [ctx, "merge_shape"], "ctx")
    o = linear(ctx, "o", d, d)
    inits += [_init("ln1.scale", np.ones(d, np.float32)), _init("ln1.bias", np.zeros(d, np.float32)),
              _init("ln2.scale", np.ones(d, np.float32)), _init("ln2.bias", np.zeros(d, np.float32))]
    h = node("LayerNormalization", [node("Add", ["x", o], "res1"), "ln1.scale", "ln1.bias"], "ln1", axis=-1, epsilon=1e-5)
    f = node("Gelu", [linear(h, "ff1", d, d_ff)], "gelu", approximate="tanh")
    f = linear(f, "ff2", d_ff, d)
    node("LayerNormalization", [node("Add", [h, f], "res2"), "ln2.scale", "ln2.bias"], "y", axis=-1, epsilon=1e-5)
    graph = helper.make_graph(nodes, "transformer_block", [helper.make_tensor_value_info("x", F, ["batch", "seq", d])],
                              [helper.make_tensor_value_info("y", F, ["batch", "seq", d])], inits)
    return _model(graph, "Transformer encoder block: 4-head self-attention + GELU MLP, post-LN (examples/make_models.py)")


def detection_postprocess(boxes: int = 1000, classes: int = 8, top_k: int = 200, max_out: int = 50) -> onnx.ModelProto:
    nodes = [
        helper.make_node("ReduceMax", ["scores", "class_axis"], ["best"], name="best_class_score", keepdims=0),
        helper.make_node("TopK", ["best", "k"], ["top_scores", "top_idx"], name="topk", axis=-1),
        helper.make_node("Gather", ["boxes", "top_idx_flat"], ["top_boxes"], name="gather_boxes", axis=1),
        helper.make_node("Reshape", ["top_idx", "flat"], ["top_idx_flat"], name="flatten_idx"),
        helper.make_node("Unsqueeze", ["top_scores", "class_axis"], ["nms_scores"], name="scores_per_class"),
        helper.make_node("NonMaxSuppression", ["top_boxes", "nms_scores", "max_out", "iou", "score_min"],
                         ["selected"], name="nms"),
    ]
    # Reshape must come before its use in a valid graph: order the nodes.
    nodes = [nodes[0], nodes[1], nodes[3], nodes[2], nodes[4], nodes[5]]
    inits = [_init("class_axis", np.array([1], np.int64)), _init("k", np.array([top_k], np.int64)),
             _init("flat", np.array([-1], np.int64)), _init("max_out", np.array([max_out], np.int64)),
             _init("iou", np.array([0.5], np.float32)), _init("score_min", np.array([0.05], np.float32))]
    graph = helper.make_graph(
        nodes, "detection_postprocess",
        [helper.make_tensor_value_info("boxes", F, [1, boxes, 4]),
         helper.make_tensor_value_info("scores", F, [1, classes, boxes])],
        [helper.make_tensor_value_info("selected", TensorProto.INT64, ["num_selected", 3]),
         helper.make_tensor_value_info("top_scores", F, [1, top_k])], inits)
    return _model(graph, "Detection post-process: best class score, TopK, NonMaxSuppression (examples/make_models.py)")


def main() -> None:
    rng = np.random.default_rng(2024)
    for name, model in (("mlp", mlp(rng)), ("transformer_block", transformer_block(rng)),
                        ("detection_postprocess", detection_postprocess())):
        path = HERE / f"{name}.onnx"
        onnx.save(model, path)
        print(f"{path.relative_to(HERE.parent)}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
