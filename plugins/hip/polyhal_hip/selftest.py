"""``python -m polyhal_hip.selftest``: what runs on *your* AMD GPU, as a JSON report.

polyhal-hip has been compiled and tested on machines without an AMD GPU only (see the README's
hardware table). An owner of one runs this and sends the report back::

    python -m polyhal_hip.selftest --out hip-selftest.json          # all checks
    python -m polyhal_hip.selftest --quick                          # allocator and DLPack only

Checks, on every AMD GPU found (or ``--device hip:1``): every heap and every buffer kind
allocated, mapped, written, read and freed by kind (device, async, managed, pinned coherent and
non-coherent, host-registered, external); DLPack export of each (device type, consumer numpy /
torch where installed), the ROCm stream rules; the core's conformance suite (every op of the
op set against its numpy reference, plans run repeatedly); both sort paths. The report names
the machine, the ROCm runtime and bindings, and each check's outcome and time.

Exit status: 0 -- everything ran on a GPU and passed; 1 -- a check failed; 2 -- no AMD GPU was
used (the report says why), so nothing ran on hardware.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np


class SkipCheck(Exception):
    """A check that cannot run here (the message says why)."""


def _check(report: list, name: str, fn: Callable[[], Any]) -> None:
    start = time.perf_counter()
    entry: dict[str, Any] = {"name": name}
    try:
        detail = fn()
        entry["status"] = "pass"
        if detail:
            entry["detail"] = detail
    except BaseException as exc:  # noqa: BLE001 - every outcome goes into the report
        if isinstance(exc, SkipCheck) or type(exc).__name__ == "Skipped":  # ours, or pytest.skip in the suite
            entry["status"], entry["detail"] = "skip", str(exc)
        elif isinstance(exc, Exception):
            entry["status"] = "fail"
            entry["detail"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-4000:]
        else:
            raise  # KeyboardInterrupt, SystemExit
    entry["seconds"] = round(time.perf_counter() - start, 4)
    report.append(entry)


def _buffer_checks(device: Any, checks: list) -> None:
    import polyhal
    from polyhal.hal.flags import BufferKind, MemoryType

    alloc = device.allocator
    for heap in alloc.heaps:
        def one(heap=heap):
            host = np.arange(4096, dtype=np.uint8)
            t = polyhal.asarray(host, device=device, memory_type=heap.memory_type)
            assert np.array_equal(t.numpy(), host)
            if heap.memory_type & MemoryType.HOST_VISIBLE:
                assert np.array_equal(np.asarray(t.buffer.map()), host)
            kind, dl = t.buffer.kind.value, t.__dlpack_device__()
            t.release()
            return f"kind {kind}, DLPack device {tuple(int(v) for v in dl)}"
        _check(checks, f"heap {heap.memory_type.describe()} ({heap.kind.value})", one)
    if device.spec.limits.get("memory_pools"):
        def asynchronous():
            before = dict(alloc.frees)
            buf = alloc.allocate(1 << 20, MemoryType.DEVICE_LOCAL, kind=BufferKind.ASYNC)
            alloc.dealloca(buf)
            buf.release()
            device.synchronize()
            assert alloc.frees.get(BufferKind.ASYNC, 0) - before.get(BufferKind.ASYNC, 0) == 1
        _check(checks, "async buffer: hipMallocFromPoolAsync, freed once (dealloca then release)", asynchronous)

    def registered():
        host = np.arange(1 << 16, dtype=np.float32)
        buf = alloc.import_host(host)
        out = np.empty_like(host)
        device.read(buf, 0, out)
        assert np.array_equal(out, host)
        buf.release()
    _check(checks, "host-registered buffer: hipHostRegister / hipHostUnregister", registered)

    def dlpack_rules():
        from polyhal.errors import DLPackError

        t = polyhal.asarray(np.ones(16, np.float32), device=device)
        for bad in (1, 2):
            try:
                t.__dlpack__(stream=bad)
            except DLPackError:
                continue
            raise AssertionError(f"stream={bad} was accepted")
        np.testing.assert_array_equal(np.from_dlpack(t, device="cpu"), np.ones(16, np.float32))
        back = polyhal.from_dlpack(t.__dlpack__(stream=0))
        assert back.device is device
        return "streams 1 and 2 refused; 0 accepted; numpy host copy"
    _check(checks, "DLPack: ROCm stream rules, numpy consumer", dlpack_rules)

    def torch_consumer():
        try:
            import torch
        except ImportError:
            raise SkipCheck("torch is not installed") from None
        if not getattr(torch.version, "hip", None):
            raise SkipCheck(f"torch {torch.__version__} is not a ROCm build")
        t = polyhal.asarray(np.arange(8, dtype=np.float32), device=device)
        tt = torch.from_dlpack(t)
        assert tt.device.type == "cuda" and tt.data_ptr() == device.buffer_address(t.buffer)
        assert tt.cpu().tolist() == list(range(8))
        return f"torch {torch.__version__} (HIP {torch.version.hip})"
    _check(checks, "DLPack: torch (ROCm build) consumes device memory without a copy", torch_consumer)


def _suite_checks(device: Any, checks: list) -> None:
    from polyhal.ops import OPS
    from polyhal.testing import conformance as suite

    for name in sorted(n for n in dir(suite) if n.startswith("test_")):
        fn = getattr(suite, name)
        if name == "test_kernel_matches_reference":
            for op in sorted(OPS):
                _check(checks, f"conformance {name}[{op}]", lambda op=op: fn(device, op))
        elif name == "test_bad_sizes_are_refused":
            for n in (0, -1, 1 << 62, 1.5, True):
                _check(checks, f"conformance {name}[{n}]", lambda n=n: fn(device, n))
        else:
            _check(checks, f"conformance {name}", lambda fn=fn: fn(device))


def run(device_names: list[str] | None = None, quick: bool = False, runtime: Any = None) -> dict[str, Any]:
    """Run the checks and return the report (a dict; ``main`` writes it as JSON)."""
    import polyhal

    from polyhal_hip import runtime as hip_runtime
    from polyhal_hip.runtime import version_tuple

    if runtime is not None:
        hip_runtime.set_runtime(runtime)
    report: dict[str, Any] = {
        "tool": "polyhal_hip.selftest", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"platform": platform.platform(), "python": sys.version.split()[0], "machine": platform.machine()},
        "runtime": {}, "devices": [], "unavailable": [], "checks": [], "ran_on_hardware": False,
    }
    try:
        rt = hip_runtime.get_runtime()
        report["runtime"]["description"] = rt.description
        report["runtime"]["fake"] = bool(rt.is_fake)
        report["runtime"]["runtime_version"] = ".".join(map(str, version_tuple(rt.runtime_version())))
        report["runtime"]["bindings"] = ".".join(map(str, rt.bindings_version()))
        report["runtime"]["compiler_version"] = ".".join(map(str, rt.compiler_version()))
    except Exception as exc:  # noqa: BLE001
        report["runtime"]["error"] = f"{type(exc).__name__}: {exc}"
    registry = polyhal.default_registry()
    report["unavailable"] = registry.unavailable_reasons().get("hip", [])
    specs = [s for s in registry.device_specs() if s.backend == "hip"
             and (not device_names or s.name in device_names)]
    for spec in specs:
        device = registry.get_device(spec.name)
        info = {"name": spec.name, "description": spec.description, "arch": spec.limits.get("arch"),
                "limits": {k: v for k, v in spec.limits.items() if isinstance(v, (int, float, str, bool))},
                "heaps": [f"{h.memory_type.describe()} ({h.kind.value})" for h in spec.heaps], "checks": []}
        _buffer_checks(device, info["checks"])
        if not quick:
            _suite_checks(device, info["checks"])
        device.synchronize()
        report["devices"].append(info)
    fake = bool(report["runtime"].get("fake"))
    report["ran_on_hardware"] = bool(specs) and not fake
    counts = {"pass": 0, "fail": 0, "skip": 0}
    for d in report["devices"]:
        for c in d["checks"]:
            counts[c["status"]] += 1
    report["summary"] = counts
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polyhal_hip.selftest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON report here (default: stdout)")
    parser.add_argument("--device", action="append", default=[], help="only this device (repeatable), e.g. hip:0")
    parser.add_argument("--quick", action="store_true", help="allocator and DLPack checks only")
    args = parser.parse_args(argv)
    report = run(args.device or None, args.quick)
    text = json.dumps(report, indent=2, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        s = report["summary"]
        print(f"polyhal-hip selftest: {s['pass']} passed, {s['fail']} failed, {s['skip']} skipped on "
              f"{len(report['devices'])} device(s); report in {args.out}")
    else:
        print(text)
    if not report["ran_on_hardware"]:
        print("no AMD GPU was used: " + "; ".join(report["unavailable"] or ["none registered"]), file=sys.stderr)
        return 2
    return 1 if report["summary"]["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
