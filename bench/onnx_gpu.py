"""The example ONNX models (examples/*.onnx) on a GPU: polyhal against onnxruntime and torch.

Two comparisons per model, each side by side in one run:

* **from numpy** (what ``polyhal run`` does): polyhal's ``program.execute(plan, feeds)`` on the
  GPU device, numpy in and out, against onnxruntime with its best provider on the machine
  (CUDA where onnxruntime was built with it, else its CPU provider on the host's cores);
* **on the device**: the compiled plan called with inputs already on the GPU, outputs left
  there, against the same model written op by op in torch on the same GPU (weights read from
  the model file) -- the MLP and the transformer block; the detection post-process has no torch
  twin here (ONNX's NonMaxSuppression is not torchvision's).

Outputs are compared before timing. ``python -m bench onnx_gpu --suffix=-h100`` on the GPU
machine; ``--device`` picks the polyhal device (default: the first CUDA one).
"""

from __future__ import annotations

import numpy as np

from bench.cuda_common import cuda_device, device_sync, gpu_time
from bench.harness import Row
from bench.onnx_models import EXAMPLES, model_inputs

#: model file, {symbolic dim: size}
CASES = [
    ("mlp.onnx", {"batch": 256}),
    ("transformer_block.onnx", {"batch": 1, "seq": 256}),
    ("transformer_block.onnx", {"batch": 16, "seq": 256}),
    ("detection_postprocess.onnx", {}),
]


def _torch_model(file: str, weights: dict[str, np.ndarray], device: str):
    """The model of ``file`` as a torch function of its inputs (None where there is none)."""
    import torch
    import torch.nn.functional as F

    w = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in weights.items()}
    if file == "mlp.onnx":
        def mlp(x):
            x = torch.relu(F.linear(x, w["fc0.weight"], w["fc0.bias"]))
            x = torch.relu(F.linear(x, w["fc1.weight"], w["fc1.bias"]))
            return torch.softmax(F.linear(x, w["fc2.weight"], w["fc2.bias"]), dim=-1)
        return mlp
    if file == "transformer_block.onnx":
        heads, dh = (int(v) for v in weights["heads_dims"])
        scale = float(weights["scale"])

        def lin(x, name):
            return x @ w[f"{name}.weight"] + w[f"{name}.bias"]

        def block(x):
            b, s, d = x.shape
            q, k, v = (lin(x, n).reshape(b, s, heads, dh).transpose(1, 2) for n in "qkv")
            attn = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1)
            ctx = (attn @ v).transpose(1, 2).reshape(b, s, d)
            h = F.layer_norm(x + lin(ctx, "o"), (d,), w["ln1.scale"], w["ln1.bias"], 1e-5)
            f = lin(F.gelu(lin(h, "ff1"), approximate="tanh"), "ff2")
            return F.layer_norm(h + f, (d,), w["ln2.scale"], w["ln2.bias"], 1e-5)
        return block
    return None


def _ort_session(path, ort):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    available = ort.get_available_providers()
    provider = "CUDAExecutionProvider" if "CUDAExecutionProvider" in available else "CPUExecutionProvider"
    return ort.InferenceSession(str(path), options, providers=[provider]), provider


def run(args) -> list[Row]:
    dev = cuda_device(args)  # first: no GPU is DeviceAbsent, before the GPU libraries are imported
    import onnx
    import onnxruntime as ort
    import torch
    from onnx import numpy_helper

    import polyhal.onnx

    rng = np.random.default_rng(0)
    reps = 5 if args.quick else 15
    rows: list[Row] = []
    for file, dims in CASES:
        path = EXAMPLES / file
        session, provider = _ort_session(path, ort)
        feeds = model_inputs(session, dims, rng)
        program = polyhal.onnx.load(path, shapes={k: v.shape for k, v in feeds.items()})
        plan = program.compile(dev.name)
        ours = program.execute(plan, feeds)
        theirs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        for name, want in theirs.items():
            np.testing.assert_allclose(ours[name], want, rtol=1e-3, atol=1e-4, err_msg=f"{file} {name}")
        shape = ", ".join(f"{k}={v}" for k, v in dims.items()) or "static shapes"
        label = f"{file.removesuffix('.onnx')} ({shape}) on {dev.name}"
        t_ours = gpu_time(lambda: program.execute(plan, feeds), number=5, repeat=reps)
        t_ort = gpu_time(lambda: session.run(None, feeds), number=5, repeat=reps)
        rows.append(Row(f"{label}, from numpy", "ms", t_ours * 1e3, t_ort * 1e3,
                        f"onnxruntime {ort.__version__} {provider.removesuffix('ExecutionProvider')}", "",
                        None, {"replay": getattr(plan.replay, "mode", None)}))

        weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
        model = _torch_model(file, weights, f"cuda:{dev.ordinal}")
        if model is None:
            continue
        inputs = [polyhal.asarray(feeds[n], device=dev) for n in program.input_names]
        out = plan(*inputs)
        tin = [torch.from_numpy(feeds[n]).to(f"cuda:{dev.ordinal}") for n in program.input_names]
        with torch.no_grad():
            want = model(*tin).cpu().numpy()
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-3, atol=1e-4, err_msg=f"{file} against torch")
        device_sync()
        t_dev = gpu_time(lambda: plan(*inputs), number=20, repeat=reps)
        with torch.no_grad():
            t_torch = gpu_time(lambda: model(*tin), number=20, repeat=reps)
        rows.append(Row(f"{label}, on the device", "ms", t_dev * 1e3, t_torch * 1e3,
                        f"torch {torch.__version__.split('+')[0]} op by op", "", None,
                        {"replay": getattr(plan.replay, "mode", None)}))
    return rows
