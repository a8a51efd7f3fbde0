"""Train a scikit-learn pipeline, export it with skl2onnx, run it on polyhal, compare with onnxruntime.

    python examples/sklearn_pipeline.py

The pipeline scales 20 features and classifies them with 40 gradient-boosted trees of depth 3.
skl2onnx exports it with an unnamed batch dim, so ``polyhal.onnx.load`` gives a shape-polymorphic
program: one load, then any batch size (a plan is compiled per new size and cached). The model's
outputs are the labels (int64) and ZipMap's probabilities, which polyhal returns as onnxruntime
does: a list with one ``{class: probability}`` dict per sample. Needs scikit-learn, skl2onnx and
onnxruntime (``pip install -r requirements-test.txt``).
"""

from __future__ import annotations

import sys
import time
import warnings

import numpy as np


def main() -> int:
    try:
        import onnxruntime as ort
        from sklearn.ensemble import GradientBoostingClassifier
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler
        from skl2onnx import to_onnx
    except ImportError as exc:
        print(f"this example needs scikit-learn, skl2onnx and onnxruntime: {exc}", file=sys.stderr)
        return 2
    import polyhal.onnx

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2000, 20)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] * x[:, 2] - x[:, 3] > 0).astype(np.int64)
    pipeline = make_pipeline(StandardScaler(), GradientBoostingClassifier(n_estimators=40, max_depth=3, random_state=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline.fit(x, y)
        model = to_onnx(pipeline, x[:1]).SerializeToString()

    program = polyhal.onnx.load(model, source="sklearn_pipeline.onnx")
    plan = program.compile()
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    print(f"pipeline: {' -> '.join(type(s).__name__ for s in pipeline)}; inputs {program.declared_inputs}")
    ok = True
    for batch in (1, 1000):
        feed = {"X": x[:batch]}
        t0 = time.perf_counter()
        ours = program.execute(plan, feed)
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours = program.execute(plan, feed)
        t_again = time.perf_counter() - t0
        labels, probabilities = session.run(None, feed)
        same_labels = ours["output_label"].tolist() == labels.tolist()
        same_probs = all(np.allclose(list(a.values()), list(b.values()), rtol=1e-5, atol=1e-6)
                         for a, b in zip(ours["output_probability"], probabilities))
        agree = np.mean(ours["output_label"] == pipeline.predict(x[:batch]))
        ok &= same_labels and same_probs
        print(f"batch {batch}: labels {'match' if same_labels else 'DIFFER from'} onnxruntime, probabilities "
              f"{'match' if same_probs else 'DIFFER'}; agreement with scikit-learn {agree:.1%}; "
              f"first call {t_first * 1e3:.1f} ms (compiles), next {t_again * 1e3:.3f} ms")
        print(f"  sample 0: label {ours['output_label'][0]}, probabilities {ours['output_probability'][0]}")
    print(plan.explain().splitlines()[0])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
