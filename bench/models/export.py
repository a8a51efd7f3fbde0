"""Export the real-model suite with torch and cut its weights out (the files beside this one).

Regenerate (needs torch, torchvision, transformers, onnxscript, onnx and onnxruntime; no
internet: every model is built from its constructor or config class with random weights)::

    python -m bench.models.export OUTDIR [MODEL ...]   # writes OUTDIR/real_models.tar.gz
    tar -xzf OUTDIR/real_models.tar.gz -C bench/models

Each model is exported in eval mode with the TorchScript exporter (``dynamo=False``, opset 17)
where that works and with the dynamo exporter where it does not (GPT-2 needs it); the CNNs get a
symbolic ``batch`` dim, and their BatchNorm statistics are calibrated on random inputs first
(see ``_calibrate``). Before cutting, onnxruntime runs the full exported model against torch
(``max_abs_err_vs_torch``), and after cutting it runs the refilled model once to show its outputs
are finite and of a sane scale; both go into ``manifest.json`` with the exporter used and the
versions. Every model is tried on its own: one that fails to export gets its error recorded.
"""

from __future__ import annotations

import json
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import onnx

from bench.models import cut, refill, fix_dims

CNNS = ["resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "densenet121", "swin_t"]
SEQ = 128


def _calibrate(net, batches: int = 4, device: str = "cpu"):
    """Give BatchNorm layers the running statistics of random inputs, as training would.

    A freshly built torchvision CNN has running mean 0 and variance 1 everywhere, so in eval mode
    its activations shrink or grow layer by layer (MobileNetV3's logits come out near 1e-10);
    a few train-mode passes with a cumulative average make every BatchNorm normalize again.
    ``device`` runs those passes (the net is moved there and back).
    """
    import torch

    norms = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return net.eval()
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    net.to(device).train()
    with torch.no_grad():
        for _ in range(batches):
            net(torch.randn(8, 3, 224, 224, device=device))
    return net.cpu().eval()


def _wrappers():
    """The modules that give the transformers a single tensor output (the ONNX graph's)."""
    import torch

    class Hidden(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, input_ids, attention_mask):
            return self.net(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    class Logits(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, input_ids):
            return self.net(input_ids=input_ids, use_cache=False).logits

    return Hidden, Logits


#: The transformers of the suite, and how their inputs are named.
TRANSFORMERS = {"distilbert_base": ["input_ids", "attention_mask"], "gpt2_6layer": ["input_ids"]}


def torch_model(name: str, batch: int = 1, *, seed: int = 0, calibrate_on: str = "cpu"):
    """One model of the suite (or any torchvision classifier by its constructor's name) with
    weights from ``seed``, in eval mode on the CPU: ``(module, example inputs of batch ``batch``,
    input names, output names, dynamic axes, exporters to try)``."""
    import torch

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if name in TRANSFORMERS:
        import transformers

        Hidden, Logits = _wrappers()
        if name == "distilbert_base":
            bert = transformers.DistilBertModel(transformers.DistilBertConfig(attn_implementation="eager")).eval()
            ids = torch.randint(0, bert.config.vocab_size, (batch, SEQ), generator=gen)
            return (Hidden(bert).eval(), (ids, torch.ones(batch, SEQ, dtype=torch.int64)),
                    TRANSFORMERS[name], ["last_hidden_state"], None, ["torchscript", "dynamo"])
        gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=6, attn_implementation="eager")).eval()
        ids = torch.randint(0, gpt.config.vocab_size, (batch, SEQ), generator=gen)
        return Logits(gpt).eval(), (ids,), TRANSFORMERS[name], ["logits"], None, ["dynamo", "torchscript"]
    import torchvision

    net = getattr(torchvision.models, name)(weights=None)
    with torch.no_grad():  # torchvision zero-initialises some layers (ViT's head): its output would be 0
        for p in net.parameters():
            if p.dim() > 1 and not p.any():
                p.normal_(0.0, 0.02, generator=gen)
    net = _calibrate(net, device=calibrate_on)
    # ViT exports only with the dynamo exporter (the TorchScript one fails on its attention).
    exporters = ["dynamo", "torchscript"] if name.startswith("vit") else ["torchscript", "dynamo"]
    return (net, (torch.randn(batch, 3, 224, 224, generator=gen),), ["input"], ["logits"],
            {"input": {0: "batch"}, "logits": {0: "batch"}}, exporters)


def _torch_models():
    """{name: (module, example inputs, input names, output names, dynamic axes, exporters to try)}."""
    import torch

    torch.manual_seed(0)
    models = {name: torch_model(name, 2) for name in CNNS}
    for name in TRANSFORMERS:
        models[name] = torch_model(name, 1)
    return models


def _export(net, inputs, in_names, out_names, dynamic, exporter, path: Path) -> None:
    import torch

    with torch.no_grad():
        if exporter == "torchscript":
            torch.onnx.export(net, inputs, str(path), dynamo=False, opset_version=17, input_names=in_names,
                              output_names=out_names, dynamic_axes=dynamic, do_constant_folding=True)
        else:
            dynamic_shapes = None
            if dynamic:
                batch = torch.export.Dim("batch", min=1, max=1024)
                dynamic_shapes = tuple({0: batch} for _ in inputs)
            program = torch.onnx.export(net, inputs, dynamo=True, opset_version=18, input_names=in_names,
                                        output_names=out_names, dynamic_shapes=dynamic_shapes, optimize=True)
            program.save(str(path))


def _ort_run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def main(out: Path, only: list[str] | None = None) -> int:
    import torch
    import torchvision
    import transformers
    import onnxruntime

    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp())
    manifest = {"versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                             "transformers": transformers.__version__, "onnx": onnx.__version__,
                             "onnxruntime": onnxruntime.__version__},
                "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "models": {}}
    torch.manual_seed(0)
    for name, (net, inputs, in_names, out_names, dynamic, exporters) in _torch_models().items():
        if only and name not in only:
            continue
        entry = {"errors": {}}
        manifest["models"][name] = entry
        with torch.no_grad():
            want = net(*inputs).numpy()
        feeds = {n: x.numpy() for n, x in zip(in_names, inputs)}
        for exporter in exporters:
            t0 = time.time()
            full_path = stage / f"{name}.full.onnx"
            try:
                _export(net, inputs, in_names, out_names, dynamic, exporter, full_path)
                full = onnx.load(str(full_path))
                got = _ort_run(full, feeds)[0]
                if got.shape != want.shape:
                    raise ValueError(f"onnxruntime gives shape {got.shape}, torch {want.shape}")
                entry["max_abs_err_vs_torch"] = err = float(np.abs(got - want).max())
                if err > 1e-3 * max(1.0, float(np.abs(want).max())):
                    raise ValueError(f"onnxruntime's output differs from torch's by {err:.3g}")
            except Exception as exc:  # noqa: BLE001  (record it, try the next exporter)
                first = str(exc).splitlines()[0][:300] if str(exc) else ""
                entry["errors"][exporter] = f"{type(exc).__name__}: {first}"
                traceback.print_exc()
                continue
            small = cut(full)
            small.doc_string = f"{name}: exported by torch {torch.__version__} ({exporter}); weights cut out"
            file = f"{name}.cut.onnx"
            onnx.save(small, str(stage / file))
            again = fix_dims(refill(onnx.load(str(stage / file)), seed=0), {"batch": 1})
            feeds1 = {k: v[:1] for k, v in feeds.items()}
            refilled = _ort_run(again, feeds1)[0]
            opset = max(o.version for o in full.opset_import if o.domain in ("", "ai.onnx"))
            entry.update(
                exporter=exporter, opset=opset, file=file, export_s=round(time.time() - t0, 1),
                inputs={i.name: {"elem_type": i.type.tensor_type.elem_type,
                                 "shape": [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]}
                        for i in small.graph.input if i.name not in {t.name for t in small.graph.initializer}},
                nodes=len(small.graph.node), full_bytes=full.ByteSize(), cut_bytes=small.ByteSize(),
                refilled_output={"finite": bool(np.isfinite(refilled).all()), "std": float(refilled.std()),
                                 "max_abs": float(np.abs(refilled).max())},
                original_output={"std": float(want.std()), "max_abs": float(np.abs(want).max())})
            print(f"{name}: {exporter}, {entry['nodes']} nodes, {entry['full_bytes'] / 1e6:.1f} MB -> "
                  f"{entry['cut_bytes'] / 1e6:.2f} MB, err vs torch {entry['max_abs_err_vs_torch']:.2e}, "
                  f"refilled std {entry['refilled_output']['std']:.3g}", flush=True)
            break
        full_path = stage / f"{name}.full.onnx"
        if full_path.exists():
            full_path.unlink()
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=1))
        # Re-pack after every model: a run cut short still returns what it finished.
        with tarfile.open(out / "real_models.tar.gz", "w:gz") as tar:
            for f in sorted(stage.iterdir()):
                tar.add(f, arcname=f.name)
    return 0 if all("file" in e for e in manifest["models"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "export-out"), sys.argv[2:]))
