"""Real models on a CUDA GPU: polyhal against torch eager and ``torch.compile``, side by side.

Each architecture is built in torch with seeded random weights (:func:`bench.models.export.torch_model`:
the torchvision CNNs of the suite plus ResNet-18, MobileNetV3-small and ViT-B/16, DistilBERT and a
6-layer GPT-2 at sequence length 128), exported to ONNX in a temporary directory with those same
weights (one file per batch size, static shapes), and loaded by polyhal. In one process, on one GPU,
with the same inputs already on the device for every side:

- polyhal on the CUDA device in its default precision (fp32), against torch eager with TF32 off
  (``torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False``) and
  against ``torch.compile(mode="reduce-overhead")`` (CUDA graphs);
- the max error of each against an fp64 torch reference (the model in double precision), relative
  to the reference's largest magnitude;
- the device memory peak of each: torch's ``max_memory_allocated`` above what was allocated before
  the model came to the GPU, and polyhal's above its own baseline -- the bytes in use in the
  device's memory pool (weights, the plan's arenas with their cuDNN workspaces, the cuBLAS
  workspace, CUDA-graph buffers, the run's outputs) after the runs, plus what cupy's default pool
  holds for kernel temporaries (its cached bytes: the high-water mark of those). Each side's
  per-device cuBLAS workspace is made before the first model and counted for neither;
- polyhal compiled with ``precision="fp16"`` against torch eager in half precision (``.half()``).

Timing: the device is synchronised around each sample of ``number`` calls (``bench.cuda_common``),
the median of the samples is reported. Targets (issue 17): CNNs no slower than torch eager at batch
1 and 16, transformers at least 3x faster than eager and no slower than torch.compile at batch 1
(and no slower than eager at batch 16), fp32 error within 1e-4 relative, device memory peak no more than torch eager's. Other rows (torch.compile
for CNNs, fp16) are recorded without a target. A model that fails on either side gets a row saying
why; a polyhal failure is a missed target.

``python -m bench gpu_models [--device cuda:0] [--quick] [--models resnet18,gpt2_6layer] [--budget 450]``:
the card's name goes into the results and their file name (``gpu_models-h100.md``) unless
``--suffix`` is given; no new model starts once ``--budget`` seconds have passed (default 450, so one
run stays within about eight minutes), and the skipped ones are listed. Without a CUDA device or
torch with CUDA, the benchmark says so and leaves the recorded results untouched.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import DeviceAbsent, Row

CNNS = ["resnet18", "resnet50", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny",
        "densenet121", "swin_t", "vit_b_16"]
TRANSFORMERS = ["distilbert_base", "gpt2_6layer"]
MODELS = CNNS + TRANSFORMERS
QUICK = ["resnet18", "resnet50", "mobilenet_v3_small", "vit_b_16", "distilbert_base", "gpt2_6layer"]
BATCHES = (1, 16)
ERROR_TARGET = 1e-4
SEED = 0


def _card(args) -> tuple[str, str]:
    """``(polyhal device name, the card's name)``; DeviceAbsent without torch+CUDA or a polyhal CUDA device."""
    try:
        import torch
    except ImportError as exc:
        raise DeviceAbsent(f"torch is not installed ({exc}); this benchmark compares against torch on the GPU")
    if not torch.cuda.is_available():
        raise DeviceAbsent("torch sees no CUDA device")
    from bench.cuda_common import cuda_device

    device = cuda_device(args)
    ordinal = int(device.spec.limits.get("ordinal", 0))
    return device.name, torch.cuda.get_device_name(ordinal)


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    if got.shape != ref.shape:
        return float("inf")
    return float(np.max(np.abs(got.astype(np.float64) - ref))) / max(float(np.max(np.abs(ref))), 1e-30)


class _PolyhalMemory:
    """polyhal's device memory above a baseline taken at construction (see the module docstring)."""

    def __init__(self, device) -> None:
        import cupy

        self.pool = device.cuda_allocator.pool
        self.default = cupy.get_default_memory_pool()
        self.default.free_all_blocks()
        self.pool.free_all_blocks()
        self.base_pool, self.base_default = self.pool.used_bytes(), self.default.total_bytes()
        self.stats = device.allocator.statistics
        for s in self.stats.by_memory_type.values():  # a peak of this model only
            s.peak_bytes = s.live_bytes
        self.base_live = self.stats.live_bytes
        self.peak = 0

    def sample(self) -> int:
        used = (self.pool.used_bytes() - self.base_pool) + (self.default.total_bytes() - self.base_default)
        self.peak = max(self.peak, used)
        return used

    def allocator_peak(self) -> int:
        """The peak of the bytes polyhal's allocator handed out (buffers only)."""
        return self.stats.peak_bytes - self.base_live


def _torch_side(name, net, inputs, runs: dict, quick: bool, device_index: int) -> dict:
    """torch eager (fp32, TF32 off), the fp64 reference, torch.compile and torch fp16 on ``inputs``."""
    import torch

    from bench.cuda_common import gpu_time

    out: dict = {}
    dev = torch.device("cuda", device_index)
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    net = net.to(dev)
    xs = tuple(x.to(dev) for x in inputs)
    with torch.no_grad():
        for _ in range(2):
            y = net(*xs)
        torch.cuda.synchronize(dev)
        out["memory"] = torch.cuda.max_memory_allocated(dev) - base
        out["fp32"] = y.float().cpu().numpy()
        del y
        out["eager_s"] = gpu_time(lambda: net(*xs), **runs)
        reference = copy.deepcopy(net).double()
        ref_in = tuple(x.double() if x.is_floating_point() else x for x in xs)
        out["fp64"] = reference(*ref_in).cpu().numpy()
        del reference, ref_in
        half = copy.deepcopy(net).half()
        half_in = tuple(x.half() if x.is_floating_point() else x for x in xs)
        out["fp16"] = half(*half_in).float().cpu().numpy()
        out["fp16_s"] = gpu_time(lambda: half(*half_in), **runs)
        half = half_in = None  # freed before torch.compile runs
    try:
        t0 = time.perf_counter()
        compiled = torch.compile(net, mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(3):  # compiles, records the CUDA graph, replays
                compiled(*xs)
            torch.cuda.synchronize(dev)
            out["compile_first_s"] = time.perf_counter() - t0
            out["compiled_s"] = gpu_time(lambda: compiled(*xs), **runs)
    except Exception as exc:  # noqa: BLE001  (a model torch.compile cannot take is a result)
        out["compile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    finally:
        compiled = None
        torch._dynamo.reset()
    net.cpu()
    xs = None
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _polyhal_side(path: str, device, feeds: dict, precision: str, runs: dict) -> dict:
    """polyhal on ``device`` for ``precision``: output, time, memory, explain's precision lines."""
    import polyhal
    import polyhal.onnx

    from bench.cuda_common import gpu_time

    gc.collect()
    memory = _PolyhalMemory(device)
    program = polyhal.onnx.load(path)
    t0 = time.perf_counter()
    plan = program.compile(device.name, precision=precision)
    compile_s = time.perf_counter() - t0
    names = program.input_names
    tensors = [polyhal.asarray(feeds[n], device=device) for n in names]
    memory.sample()
    result = plan(*tensors)
    first = result[0] if isinstance(result, tuple) else result
    got = first.numpy()
    del result, first
    seconds = gpu_time(lambda: plan(*tensors), **runs)
    keep = plan(*tensors)  # the outputs of a run are alive while the peak is sampled
    device.synchronize()
    memory.sample()
    del keep
    lines = [line.strip() for line in plan.explain().splitlines() if line.strip().startswith("precision")]
    info = {"out": got, "s": seconds, "compile_s": compile_s, "memory": memory.peak,
            "allocator_peak": memory.allocator_peak(), "precision": lines[0] if lines else "",
            "replay": plan.replay is not None}
    plan = program = tensors = None
    gc.collect()
    return info


def _case(name: str, batch: int, device, quick: bool, workdir: Path) -> list[Row]:
    import torch

    from bench.models.export import _export, torch_model

    case = f"{name} b{batch}"
    transformer = name in TRANSFORMERS
    runs = {"number": 5, "repeat": 7, "warmup": 2} if quick else {"number": 10, "repeat": 15, "warmup": 3}
    net, inputs, in_names, out_names, _, exporters = torch_model(name, batch, seed=SEED,
                                                                 calibrate_on=f"cuda:{_ordinal(device)}")
    path = workdir / f"{name}-b{batch}.onnx"
    errors = {}
    for exporter in exporters:
        try:
            _export(net, inputs, in_names, out_names, None, exporter, path)
            break
        except Exception as exc:  # noqa: BLE001  (try the next exporter)
            errors[exporter] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    else:
        return [Row(f"{case}: torch could not export it ({errors})", "ms", float("nan"), float("nan"), "torch eager")]
    feeds = {n: x.numpy() for n, x in zip(in_names, inputs)}
    t = _torch_side(name, net, inputs, runs, quick, _ordinal(device))
    del net
    anchor = f"torch {torch.__version__} eager fp32, TF32 off"
    rows = []
    try:
        ours = _polyhal_side(str(path), device, feeds, "fp32", runs)
    except Exception as exc:  # noqa: BLE001  (a model polyhal cannot take yet is a result, not a crash)
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:240]
        return [Row(f"{case} fp32: polyhal failed ({why})", "ms", float("nan"), t["eager_s"] * 1e3, anchor,
                    "runs", False)]
    err_p, err_t = _rel_err(ours["out"], t["fp64"]), _rel_err(t["fp32"], t["fp64"])
    correct = err_p <= ERROR_TARGET
    extra = {"batch": batch, "compile_s": ours["compile_s"], "cuda_graph": ours["replay"],
             "polyhal_rel_err": err_p, "torch_rel_err": err_t, "exporter": next(iter(
                 e for e in exporters if e not in errors), None)}
    # The targets: transformers 3x faster than eager at batch 1 (where launches dominate),
    # every model no slower than eager otherwise.
    eager_target = 1 / 3 if transformer and batch == 1 else 1.0
    rows.append(Row(f"{case} fp32 vs torch eager", "ms", ours["s"] * 1e3, t["eager_s"] * 1e3, anchor,
                    f"<= {eager_target:.3g}x", correct and ours["s"] <= eager_target * t["eager_s"], extra))
    if "compiled_s" in t:
        aim = transformer and batch == 1
        rows.append(Row(f"{case} fp32 vs torch.compile", "ms", ours["s"] * 1e3, t["compiled_s"] * 1e3,
                        f"torch {torch.__version__} compile reduce-overhead", "<= 1x" if aim else "(aim 1x)",
                        (correct and ours["s"] <= t["compiled_s"]) if aim else None,
                        {"batch": batch, "torch_compile_first_s": t["compile_first_s"]}))
    else:
        rows.append(Row(f"{case} torch.compile failed ({t['compile_error']})", "ms", ours["s"] * 1e3, float("nan"),
                        "torch.compile"))
    rows.append(Row(f"{case} fp32 max error vs fp64 (relative)", "rel", err_p, err_t, "torch eager fp32",
                    f"<= {ERROR_TARGET:g}", correct))
    rows.append(Row(f"{case} device memory peak", "MB", ours["memory"] / 2**20, t["memory"] / 2**20,
                    "torch eager max_memory_allocated", "<= 1x", ours["memory"] <= t["memory"],
                    {"polyhal_allocator_peak_mb": ours["allocator_peak"] / 2**20}))
    try:
        half = _polyhal_side(str(path), device, feeds, "fp16", runs)
        rows.append(Row(f"{case} fp16 vs torch fp16 eager", "ms", half["s"] * 1e3, t["fp16_s"] * 1e3,
                        f"torch {torch.__version__} eager .half()", "", None,
                        {"polyhal_rel_err": _rel_err(half["out"], t["fp64"]),
                         "torch_rel_err": _rel_err(t["fp16"], t["fp64"]), "explain": half["precision"],
                         "cuda_graph": half["replay"], "polyhal_memory_mb": half["memory"] / 2**20}))
    except Exception as exc:  # noqa: BLE001
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:240]
        rows.append(Row(f"{case} fp16: polyhal failed ({why})", "ms", float("nan"), t["fp16_s"] * 1e3,
                        "torch eager .half()", "runs", False))
    return rows


def _ordinal(device) -> int:
    return int(device.spec.limits.get("ordinal", 0))


def _no_tf32() -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _persistent_workspaces(device) -> None:
    """Make each side's per-device cuBLAS workspace now, so that no model's peak counts it."""
    import torch
    from polyhal_cuda import blas

    a = torch.ones(64, 64, device=f"cuda:{_ordinal(device)}")
    (a @ a).sum().item()
    blas.blas_for(device)


def run(args) -> list[Row]:
    import polyhal

    name, card = _card(args)
    device = polyhal.get_device(name)
    os.environ.setdefault("POLYHAL_BENCH_GPU", card)
    if not args.suffix:
        short = next((m for m in ("h200", "h100", "a100", "l40s", "l4") if m in card.lower()), "gpu")
        args.suffix = f"-{short}"
    _no_tf32()
    _persistent_workspaces(device)
    wanted = [m.strip() for m in (getattr(args, "models", None) or "").split(",") if m.strip()] or (
        QUICK if args.quick else MODELS)
    unknown = [m for m in wanted if m not in MODELS]
    if unknown:
        raise SystemExit(f"gpu_models: unknown model(s) {unknown}; known: {MODELS}")
    budget = float(getattr(args, "budget", None) or 450)
    start = time.perf_counter()
    rows: list[Row] = []
    skipped = []
    with tempfile.TemporaryDirectory(prefix="polyhal-gpu-models-") as tmp:
        for model in wanted:
            for batch in BATCHES:
                if time.perf_counter() - start > budget:
                    skipped.append(f"{model} b{batch}")
                    continue
                t0 = time.perf_counter()
                try:
                    rows += _case(model, batch, device, args.quick, Path(tmp))
                except Exception as exc:  # noqa: BLE001  (the torch side failed: record it, go on)
                    why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:240]
                    rows.append(Row(f"{model} b{batch}: the torch side failed ({why})", "ms", float("nan"),
                                    float("nan"), "torch eager"))
                print(f"gpu_models: {model} b{batch} took {time.perf_counter() - t0:.0f} s", file=sys.stderr,
                      flush=True)
    if skipped:
        print(f"gpu_models: budget of {budget:.0f} s spent; not measured: {', '.join(skipped)} "
              "(run them with --models)", file=sys.stderr)
    return rows
