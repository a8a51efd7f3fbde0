"""Real models (bench/models: torchvision CNNs, DistilBERT, a 6-layer GPT-2) on polyhal against
onnxruntime's CPU provider.

Each model is refilled from a seed (see :mod:`bench.models`), its batch fixed (1 and 8 for the
CNNs), written once to a temporary file, and both runtimes load that same file and get the same
random inputs in one process. The outputs are compared first (max abs error against onnxruntime,
and that error relative to the largest output), the compiled plan's and those of
``polyhal.InferenceSession`` (the onnxruntime-style API) alike; then both are timed in alternating blocks after
a warm-up (median and p90 per run). Peak resident memory is measured for each in a process of
its own (``ru_maxrss`` of a child that loads the model and runs it twice). Thread counts of both
are recorded. Targets (issue 16): polyhal's median within 1.5x of onnxruntime's at batch 1 and at
batch 8, and its peak memory within 1.2x. A model that polyhal cannot load or run gets a row
saying why, marked missed.

``python -m bench real_models [--quick] [--models resnet50,gpt2_6layer] [--device cpu:0]``
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import RESULTS, Row, busy_core, machine

#: Batch sizes per model (CNNs have a symbolic ``batch`` dim; the transformers are fixed at 1 x 128).
BATCHES = {"resnet50": (1, 8), "mobilenet_v3_large": (1, 8), "efficientnet_b0": (1, 8), "convnext_tiny": (1, 8),
           "densenet121": (1, 8), "swin_t": (1, 8), "distilbert_base": (1,), "gpt2_6layer": (1,)}
TIME_TARGET = 1.5
MEMORY_TARGET = 1.2
SEED = 0


def feeds_for(path: str) -> dict[str, np.ndarray]:
    """Deterministic random inputs for a static model file: images ~ N(0, 1), token ids in range."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    rng = np.random.default_rng(SEED)
    init = {t.name for t in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in init:
            continue
        t = value.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        if t.elem_type == onnx.TensorProto.INT64:
            feeds[value.name] = (np.ones(shape, np.int64) if "mask" in value.name
                                 else rng.integers(0, 30000, shape, dtype=np.int64))
        else:
            feeds[value.name] = rng.standard_normal(shape, dtype=np.float32)
    return feeds


def _ort_session(path: str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _polyhal_runner(path: str, device: str):
    import polyhal.onnx

    program = polyhal.onnx.load(path)
    plan = program.compile(device)
    return program, plan


def _session_error(path: str, device: str, feeds: dict, names: list[str], theirs: list, extra: dict) -> float:
    """The largest error of ``polyhal.InferenceSession(path, device).run(None, feeds)`` against
    onnxruntime's outputs, relative to their largest value: the session API (what a user switching
    from onnxruntime calls) checked on every real model, beside the compiled plan that is timed."""
    import polyhal

    got = polyhal.InferenceSession(path, device).run(None, feeds)
    if [np.shape(g) for g in got] != [w.shape for w in theirs]:
        extra["error"] = f"InferenceSession's output shapes {[np.shape(g) for g in got]}"
        return float("inf")
    worst = max(float(np.abs(np.asarray(g, np.float64) - w).max()) for g, w in zip(got, theirs))
    return worst / max(extra.get("output_max_abs", 0.0), 1e-30)


def _threads(device: str) -> dict:
    """What each side may use: onnxruntime's intra-op pool, polyhal's kernel pool and the BLAS."""
    info = {"onnxruntime_intra_op": f"default (one per physical core; {os.cpu_count()} logical CPUs here)"}
    env = {k: os.environ[k] for k in ("POLYHAL_CPU_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                       "NUMBA_NUM_THREADS", "POLYHAL_CPU_ONEDNN", "OMP_WAIT_POLICY")
           if k in os.environ}
    info["env"] = env
    if device.startswith("cpu"):
        try:
            from polyhal_cpu import onednn
            from polyhal_cpu.parallel import threads

            info["polyhal_cpu_pool"] = threads()
            version, why = onednn.status()
            info["onednn"] = version or f"not used: {why}"  # convs (and, with brgemm, matmuls) as its primitives
        except ImportError:
            pass
    try:
        from threadpoolctl import threadpool_info

        info["native_pools"] = sorted({f"{p['internal_api']}={p['num_threads']}" for p in threadpool_info()})
    except ImportError:
        pass
    return info


def _rss_mb(field: str) -> float:
    """``VmHWM`` (peak) or ``VmRSS`` of this process in MB. Not ``ru_maxrss``: Linux carries that
    across ``execve``, so a child started by a big parent would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_memory(side: str, path: str, device: str) -> dict:
    """Peak resident memory (MB) of a fresh process that loads ``path`` on ``side`` and runs it
    twice on the inputs saved beside it (``.npz``)."""
    proc = subprocess.run([sys.executable, "-m", "bench.real_models", "--memory", side, path, device],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["exit " + str(proc.returncode)])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _memory_child(side: str, path: str, device: str) -> None:
    with np.load(Path(path).with_suffix(".npz")) as saved:
        feeds = dict(saved)
    if side == "onnxruntime":
        import onnxruntime  # noqa: F401  (imports count in the baseline, as polyhal's do)
    else:
        import polyhal.onnx  # noqa: F401
    before = _rss_mb("VmRSS")
    if side == "onnxruntime":
        session = _ort_session(path)
        for _ in range(2):
            session.run(None, feeds)
    else:
        program, plan = _polyhal_runner(path, device)
        for _ in range(2):
            program.execute(plan, feeds)
    peak = _rss_mb("VmHWM")
    print(json.dumps({"peak_mb": peak, "before_load_mb": before}))


def _timed(fn, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def _p90(xs: list[float]) -> float:
    return float(np.percentile(xs, 90))


#: Under one busy core, polyhal's ratio to onnxruntime may worsen by this factor at most.
LOADED_TARGET = 1.2


def _alternating(ours, theirs, runs: int) -> tuple[list[float], list[float]]:
    """Seconds per call of both sides, in alternating blocks with a pause before each, so that
    drift and other processes hit both alike and neither side starts on cores the other's
    spinning threads still hold."""
    tp, to = [], []
    block = max(1, min(5, runs))
    while len(tp) < runs:
        time.sleep(0.3)
        tp += _timed(ours, block)
        time.sleep(0.3)
        to += _timed(theirs, block)
    return tp, to


def _case(name: str, batch: int, device: str, runs: int, warmup: int, workdir: Path,
          loaded: bool = False) -> list[Row]:
    """The time row and the memory row of one model at one batch size (and with ``loaded``, the
    ratio's change when another process keeps one core busy)."""
    import onnx
    import onnxruntime as ort

    from bench.models import materialize

    case = f"{name} b{batch} on {device}"
    anchor = f"onnxruntime {ort.__version__} CPU"
    path = str(workdir / f"{name}-b{batch}.onnx")
    onnx.save(materialize(name, {"batch": batch}, seed=SEED), path)
    feeds = feeds_for(path)
    np.savez(Path(path).with_suffix(".npz"), **feeds)
    session = _ort_session(path)
    theirs = session.run(None, feeds)
    t_ort = _timed(lambda: session.run(None, feeds), warmup)
    extra = {"batch": batch, "load_average": os.getloadavg()[0]}
    try:
        t0 = time.perf_counter()
        program, plan = _polyhal_runner(path, device)
        extra["compile_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours = program.execute(plan, feeds)
        extra["first_run_s"] = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001  (a model polyhal cannot take yet is a result, not a crash)
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:240]
        extra["error"] = why
        ort_ms = statistics.median(t_ort) * 1e3
        return [Row(f"{case}: polyhal failed ({why})", "ms", float("nan"), ort_ms, anchor,
                    f"<= {TIME_TARGET}x", False, extra)]
    out_names = [o.name for o in session.get_outputs()]
    errors = []
    for out_name, want in zip(out_names, theirs):
        got = np.asarray(ours[out_name])
        if got.shape != want.shape:
            errors.append(float("inf"))
            extra["error"] = f"output {out_name}: shape {got.shape}, onnxruntime's {want.shape}"
            continue
        errors.append(float(np.abs(got.astype(np.float64) - want).max()))
        extra["output_max_abs"] = float(np.abs(want).max())
    extra["max_abs_err"] = max(errors)
    extra["rel_err"] = max(errors) / max(extra.get("output_max_abs", 0.0), 1e-30)
    extra["session_rel_err"] = _session_error(path, device, feeds, out_names, theirs, extra)
    _timed(lambda: program.execute(plan, feeds), max(warmup - 1, 0))
    tp, to = _alternating(lambda: program.execute(plan, feeds), lambda: session.run(None, feeds), runs)
    loaded_row = None
    if loaded:
        with busy_core():
            lp, lo = _alternating(lambda: program.execute(plan, feeds), lambda: session.run(None, feeds), runs)
        idle = statistics.median(tp) / statistics.median(to)
        busy = statistics.median(lp) / statistics.median(lo)
        loaded_row = Row(f"{case} ratio under one busy core", "x", busy, idle, "its ratio with no load added",
                         f"<= {LOADED_TARGET}x", busy <= LOADED_TARGET * idle,
                         {"median_ms_polyhal_loaded": statistics.median(lp) * 1e3,
                          "median_ms_onnxruntime_loaded": statistics.median(lo) * 1e3})
    extra.update(runs=len(tp), p90_ms_polyhal=_p90(tp) * 1e3, p90_ms_onnxruntime=_p90(to) * 1e3,
                 min_ms_polyhal=min(tp) * 1e3, min_ms_onnxruntime=min(to) * 1e3, threads=_threads(device),
                 ops=len(plan.program.ops), nodes=program.node_count)
    del program, plan, session
    med_p, med_o = statistics.median(tp), statistics.median(to)
    ok_output = max(extra["rel_err"], extra["session_rel_err"]) <= 1e-3
    note = "" if ok_output else (f" (outputs differ: rel err {extra['rel_err']:.2g}, through "
                                 f"polyhal.InferenceSession {extra['session_rel_err']:.2g})")
    rows = [Row(case + note, "ms", med_p * 1e3, med_o * 1e3, anchor, f"<= {TIME_TARGET}x",
                ok_output and med_p <= TIME_TARGET * med_o, extra)]
    if loaded_row is not None:
        rows.append(loaded_row)
    mem_p, mem_o = _peak_memory("polyhal", path, device), _peak_memory("onnxruntime", path, device)
    if "error" in mem_p or "error" in mem_o:
        rows.append(Row(f"{case} peak memory: not measured ({mem_p.get('error') or mem_o.get('error')})", "MB",
                        float("nan"), float("nan"), anchor, f"<= {MEMORY_TARGET}x", False,
                        {"polyhal": mem_p, "onnxruntime": mem_o}))
    else:
        rows.append(Row(f"{case} peak memory", "MB", mem_p["peak_mb"], mem_o["peak_mb"], anchor,
                        f"<= {MEMORY_TARGET}x", mem_p["peak_mb"] <= MEMORY_TARGET * mem_o["peak_mb"],
                        {"polyhal": mem_p, "onnxruntime": mem_o}))
    return rows


def _detail(rows: list[Row], suffix: str) -> None:
    """``real_models<suffix>-detail.md``: the columns the common table has no room for."""
    from bench.models import manifest

    models = manifest()["models"]
    lines = ["| case | exported by | polyhal median / p90 ms | onnxruntime median / p90 ms | ratio | runs "
             "| max abs err (rel) | compile s | load avg |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r.extra
        if r.unit != "ms" or "p90_ms_polyhal" not in e:
            continue
        exported = models.get(r.case.split()[0], {})
        lines.append(f"| {r.case} | {exported.get('exporter')} (opset {exported.get('opset')}) "
                     f"| {r.polyhal:.1f} / {e['p90_ms_polyhal']:.1f} | {r.anchor:.1f} / "
                     f"{e['p90_ms_onnxruntime']:.1f} | {r.ratio:.2f} | {e['runs']} | {e['max_abs_err']:.2g} "
                     f"({e['rel_err']:.1g}) | {e['compile_s']:.1f} | {e['load_average']:.2f} |")
    threads = next((r.extra["threads"] for r in rows if "threads" in r.extra), {})
    m = machine()
    text = (f"# real_models, details\n\nMachine: {', '.join(f'{k}: {v}' for k, v in m.items())}.\n\n"
            f"Threads: {json.dumps(threads)}\n\n" + "\n".join(lines) + "\n")
    (RESULTS / f"real_models{suffix}-detail.md").write_text(text)


def run(args) -> list[Row]:
    from bench.models import manifest

    device = args.device or "cpu:0"
    known = manifest()["models"]
    wanted = [m.strip() for m in (getattr(args, "models", None) or "").split(",") if m.strip()] or list(BATCHES)
    unknown = [m for m in wanted if m not in known]
    if unknown:
        raise SystemExit(f"real_models: unknown model(s) {unknown}; known: {sorted(known)}")
    runs, warmup = (5, 1) if args.quick else (30, 3)
    rows = []
    with tempfile.TemporaryDirectory(prefix="polyhal-real-models-") as tmp:
        for name in wanted:
            if "file" not in known[name]:
                rows.append(Row(f"{name}: not exported ({known[name].get('errors')})", "ms", float("nan"),
                                float("nan"), "onnxruntime", f"<= {TIME_TARGET}x", False))
                continue
            for batch in BATCHES.get(name, (1,)):
                t0 = time.perf_counter()
                rows += _case(name, batch, device, runs, warmup, Path(tmp), getattr(args, "loaded", False))
                print(f"real_models: {name} b{batch} took {time.perf_counter() - t0:.0f} s", file=sys.stderr,
                      flush=True)
    _detail(rows, args.suffix)
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--memory":
        _memory_child(*sys.argv[2:])
    else:
        raise SystemExit("usage: python -m bench real_models [--quick] [--models a,b] [--device cpu:0] [--loaded]")
