"""Temporary: list the steps of one ViT layer (ops, shapes) on cuda:0."""
import tempfile
from pathlib import Path
import polyhal, polyhal.onnx
from bench.models.export import _export, torch_model
work = Path(tempfile.mkdtemp())
net, inputs, in_names, out_names, dyn, exporters = torch_model("vit_b_16", 2, seed=0)
path = work / "vit.onnx"
_export(net, inputs, in_names, out_names, None, "dynamo", path)
program = polyhal.onnx.load(str(path))
plan = program.compile("cuda:0")
text = plan.explain()
lines = text.splitlines()
print(len(lines))
for l in lines[:140]: print(l[:230])
