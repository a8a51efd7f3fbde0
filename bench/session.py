"""Session creation: ``polyhal.InferenceSession(model, "cpu:0")`` against onnxruntime's
``InferenceSession(model, providers=["CPUExecutionProvider"])`` for the example models.

Three rows per model. "first": the first session of a fresh interpreter, its imports (polyhal,
onnx, onnxruntime) done before the clock starts, so that the devices, plugins and kernels set
up on first use are in it -- what a user's script pays once; "first session and run" adds its
first run (inputs of ones, symbolic dims 1), where a model with symbolic dims compiles. "again": later sessions in that
process (median, one of each made first), what reading, importing and compiling the model
costs (onnxruntime: reading, graph optimization, kernel creation). A model with symbolic dims
compiles per shape on its first run in polyhal (onnxruntime has no such step), so its creation
is the import alone.
Target (issue 31): polyhal <= 2x onnxruntime.

The fresh interpreters run after one untimed process of each kind, with byte code written
(an installed package has it), so that caches are as a user's second process finds them: the
checked-model cache of the ONNX front end (polyhal.frontends.onnx.validation), the CPU's
compiled loops.

Where the first-process rows stand (busy 2-core Intel Xeon VM with AVX-512, load 3-5,
2026-12-08, bench/results/session-session2-busy.md): the creation of a model with symbolic dims is 0.3-0.9x onnxruntime's;
the rows that include a compile (the first run of mlp and transformer_block, the creation of the
static detection_postprocess) are 4-7x in wall time, ~3.5x in CPU time (the VM's load makes the
wall-clock ratios swing: compare CPU time, docs/design-notes.md "Session creation"). "session
again" of the static model binds the compile of the process's first session (the session cache,
POLYHAL_SESSION_CACHE): 0.1-0.5x. Before (the same VM, 2026-12-07) the first-process rows were
27-48x (2-core AMD EPYC VM): every installed backend plugin was imported with the registry (backends now load on
demand: docs/architecture.md, "Plugins load on demand"), ONNX's checker set up its op schemas in
each process (50-100 ms; now read back from the checked-model cache), and the CPU's prologue
fusion loaded oneDNN for models without a conv. Then (issue 31, branch firstsession, the same
VM, load 1.3-2.8, bench/results/session-firstsession-busy.md; CPU time main -> branch, side by
side in one run: mlp first session and run 39 -> 27 ms, transformer_block 43 -> 31 ms,
detection_postprocess's first session 26 -> 18 ms): BLAS is pinned through numpy's own OpenBLAS
setter (threadpoolctl's import and library scan cost ~3 ms), oneDNN is not loaded for products
of fewer than 16 rows against weights nor for small softmaxes (~4-5 ms), and the kernel modules
and the oneDNN wrappers are imported at their first op (KernelTable.register_lazily). What is
left (CPU time, detection_postprocess): the registry ~4 ms (entry-point scan, built-in
policies), importing the CPU plugin ~4.5 ms (its settings' frozen dataclass ~1 ms, the kernel
table, the pool), creating the device ~2 ms, loading, checking (cached) and compiling the model
~5.5 ms; mlp and transformer_block add the AOT-compiled loops' module (~3.4 ms: its name's
hash of the sources, the sha256 check of the 1.1 MB module, its load) and their compile.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.harness import Row, median_time

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODELS = ("mlp", "transformer_block", "detection_postprocess")
#: Most polyhal's session creation may take, in multiples of onnxruntime's.
TARGET_RATIO = 2.0


_FIRST = """import time, numpy as np, onnx, onnxruntime as ort, polyhal, polyhal.onnx
t = time.perf_counter()
if {polyhal!r}:
    session = polyhal.InferenceSession({path!r}, {device!r})
else:
    session = ort.InferenceSession({path!r}, providers=["CPUExecutionProvider"])
made = time.perf_counter()
feeds = {{i.name: np.ones([d if isinstance(d, int) else 1 for d in i.shape], np.float32) for i in session.get_inputs()}}
session.run(None, feeds)
print(made - t, time.perf_counter() - t)"""


#: The fresh interpreters' environment: byte code written and read (PYTHONDONTWRITEBYTECODE,
#: which a test or CI shell may set, would make each of them compile polyhal's sources again,
#: which an installed package never does).
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def first_session_seconds(path: str, device: str, polyhal: bool) -> tuple[float, float]:
    """Seconds the first session of a fresh interpreter takes to create (imports excluded), and
    to create and run once (inputs of ones, symbolic dims 1)."""
    out = subprocess.run([sys.executable, "-c", _FIRST.format(path=path, device=device, polyhal=polyhal)],
                         capture_output=True, text=True, check=True, env=_ENV)
    made, ran = out.stdout.strip().splitlines()[-1].split()
    return float(made), float(ran)


def run(args) -> list[Row]:
    import onnxruntime as ort

    import polyhal

    device = args.device or "cpu:0"
    repeat = 5 if args.quick else 21
    rows = []
    for name in MODELS:
        path = str(EXAMPLES / f"{name}.onnx")
        for polyhal_first in (True, False):  # untimed: byte code and caches as a user's second process finds them
            first_session_seconds(path, device, polyhal_first)
        firsts = [(first_session_seconds(path, device, True), first_session_seconds(path, device, False))
                  for _ in range(3 if args.quick else 7)]  # in turn: a busy moment hits both alike
        for k, what in enumerate(("first session of a process", "first session and run of a process")):
            p, a = (statistics.median(f[i][k] for f in firsts) for i in (0, 1))
            rows.append(Row(f"{name}: {what} ({device})", "ms", p * 1e3, a * 1e3, "onnxruntime",
                            f"<= {TARGET_RATIO:g}x", p <= TARGET_RATIO * a,
                            {"runs": len(firsts), "polyhal_ms": [round(f[0][k] * 1e3, 1) for f in firsts],
                             "anchor_ms": [round(f[1][k] * 1e3, 1) for f in firsts]}))
        p = median_time(lambda: polyhal.InferenceSession(path, device), repeat=repeat, warmup=1)
        a = median_time(lambda: ort.InferenceSession(path, providers=["CPUExecutionProvider"]), repeat=repeat,
                        warmup=1)
        rows.append(Row(f"{name}: session again ({device})", "ms", p * 1e3, a * 1e3, "onnxruntime",
                        f"<= {TARGET_RATIO:g}x", p <= TARGET_RATIO * a,
                        {"runs": repeat, "load_average": os.getloadavg()}))
    return rows
