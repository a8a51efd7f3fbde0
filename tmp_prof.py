"""Temporary: profile transformer models on cuda:0 against torch (per-op table)."""
import sys, tempfile, time
from pathlib import Path
import numpy as np, torch
import polyhal, polyhal.onnx
from bench.models.export import _export, torch_model
work = Path(tempfile.mkdtemp())
for name, batch in [(a.split(":")[0], int(a.split(":")[1])) for a in sys.argv[1:]]:
    net, inputs, in_names, out_names, dyn, exporters = torch_model(name, batch, seed=0)
    path = work / f"{name}{batch}.onnx"
    for e in exporters:
        try:
            _export(net, inputs, in_names, out_names, None, e, path); break
        except Exception as exc:
            print("export", e, "failed", exc)
    program = polyhal.onnx.load(str(path))
    plan = program.compile("cuda:0")
    dev = polyhal.get_device("cuda:0")
    xs = [polyhal.asarray(x.numpy(), device=dev) for x in inputs]
    for _ in range(3): plan(*xs)
    dev.synchronize(); t = time.perf_counter()
    for _ in range(20): plan(*xs)
    dev.synchronize(); print(f"== {name} b{batch}: {(time.perf_counter()-t)/20*1e3:.3f} ms/run (replay)")
    prof = plan.profile(*xs, runs=5)
    for g in prof.by_op()[:12]:
        print(f"  {g['op']:<22} steps {g['steps']:>4} calls {g['calls']:>5} total {g['total_ms']:8.3f} ms mean {g['mean_us']:8.1f} us {100*g['share']:5.1f}%")
    rows = sorted(prof.rows(), key=lambda r: -r["total_ms"])[:6]
    for r in rows: print("   step", r["op"], r["node"][:60], f"{r['mean_us']:.1f} us")
    with torch.no_grad():
        tn = net.cuda(); ti = [x.cuda() for x in inputs]
        for _ in range(3): tn(*ti)
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(20): tn(*ti)
        torch.cuda.synchronize(); print(f"   torch eager {(time.perf_counter()-t)/20*1e3:.3f} ms")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            for _ in range(5): tn(*ti)
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=10))
