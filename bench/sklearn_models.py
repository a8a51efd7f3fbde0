"""A scikit-learn gradient-boosting pipeline exported by skl2onnx, on polyhal's CPU against
onnxruntime's CPU execution provider, in the same run.

The pipeline (issue 19's target): StandardScaler then GradientBoostingClassifier, 40 trees of
depth 3 over 20 features, binary, exported with skl2onnx as Scaler, TreeEnsembleClassifier, Cast
and ZipMap. Both sides return the same outputs: the labels and ZipMap's list of {class: probability}
dicts. polyhal runs the model as loaded (``polyhal.onnx.load`` of the file, shape-polymorphic:
the batch dim is unnamed), so each timing includes its shape dispatch. onnxruntime runs with one
thread per session option default and its graph optimizations on.

Target: no slower than onnxruntime at batch 1 and at batch 1,000: the median over rounds of the
ratio of the two (they alternate, so a shared machine's load falls on both alike) <= 1.0.
``python -m bench sklearn_models`` writes bench/results/sklearn_models.{json,md} and exits non-zero
when a target is missed.
"""

from __future__ import annotations

import warnings

import numpy as np

from bench.harness import Row, paired_times

TREES, DEPTH, FEATURES = 40, 3, 20


def pipeline_model(seed: int = 0) -> tuple[bytes, np.ndarray]:
    """The exported pipeline and its training matrix."""
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from skl2onnx import to_onnx

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2000, FEATURES)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] * x[:, 2] - x[:, 3] > 0).astype(np.int64)
    pipe = make_pipeline(StandardScaler(), GradientBoostingClassifier(n_estimators=TREES, max_depth=DEPTH,
                                                                        random_state=seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.fit(x, y)
        return to_onnx(pipe, x[:1]).SerializeToString(), x


def run(args) -> list[Row]:
    import onnxruntime as ort

    import polyhal.onnx as ponnx

    model, x = pipeline_model()
    device = args.device or "cpu:0"
    program = ponnx.load(model, source="gradient_boosting.onnx")
    plan = program.compile(device)
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    repeat = 5 if args.quick else 40
    rows = []
    for batch in (1, 1000):
        feed = {"X": np.ascontiguousarray(x[:batch])}
        ours = program.execute(plan, feed)
        theirs = session.run(None, feed)
        assert ours["output_label"].tolist() == theirs[0].tolist(), "labels differ from onnxruntime"
        assert all(np.allclose(list(a.values()), list(b.values()), rtol=1e-5, atol=1e-6)
                   for a, b in zip(ours["output_probability"], theirs[1])), "probabilities differ from onnxruntime"
        number = 200 if batch == 1 else 5
        t_ours, t_ort, ratio = paired_times(lambda: program.execute(plan, feed), lambda: session.run(None, feed),
                                            repeat=repeat, number=number)
        rows.append(Row(f"GB pipeline {TREES} trees depth {DEPTH}, {FEATURES} features, batch {batch}", "µs",
                        t_ours * 1e6, t_ort * 1e6, f"onnxruntime {ort.__version__} CPU EP",
                        "no slower (median ratio <= 1.0)", ratio <= 1.0,
                        {"device": device, "median_ratio": round(ratio, 3)}))
    return rows


if __name__ == "__main__":
    raise SystemExit("run it as: python -m bench sklearn_models")
