"""OpenCL backend: kernels and dispatch against numpy on the same machine.

``python -m bench opencl_ops [--device opencl:N]``. Each row times one polyhal plan on the OpenCL
device (inputs already on the device, queue finished after each run) against the numpy call
computing the same thing. On a CPU OpenCL device (PoCL) numpy is the honest anchor: both use the
same cores. The dispatch row measures what a plan costs per kernel with (almost) no work.
"""

from __future__ import annotations

import numpy as np

import polyhal
from bench.harness import Row, median_time


def _plan(device: str, build) -> polyhal.Plan:
    b = polyhal.ProgramBuilder("bench")
    build(b)
    return polyhal.compile(b.build(), device)


def _device(args) -> polyhal.Device | None:
    specs = [s for s in polyhal.devices() if s.backend == "opencl"]
    if args.device and args.device.startswith("opencl:"):
        return polyhal.get_device(args.device)
    return polyhal.get_device(specs[0].name) if specs else None


def run(args) -> list[Row]:
    dev = _device(args)
    if dev is None:
        print("opencl_ops: no OpenCL device; nothing to measure")
        return []
    repeat = 5 if args.quick else 20
    rng = np.random.default_rng(0)
    rows = []

    def case(name: str, build, inputs: list[np.ndarray], anchor, unit_scale: float = 1e3, unit: str = "ms",
             extra: dict | None = None) -> None:
        plan = _plan(dev.name, build)
        staged = [polyhal.asarray(x, device=dev) for x in inputs]
        ours = median_time(lambda: plan(*staged), repeat=repeat, sync=dev.synchronize)
        ref = median_time(lambda: anchor(*inputs), repeat=repeat)
        rows.append(Row(name, unit, ours * unit_scale, ref * unit_scale, "numpy", extra=extra or {}))

    n = 512
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    case(f"matmul {n}x{n} float32", lambda p: p.output(p.matmul(p.input("a", (n, n)), p.input("b", (n, n)))),
         [a, b], np.matmul, extra={"gflop": 2 * n ** 3 / 1e9})
    x = rng.standard_normal((256, 1024), np.float32)
    case("softmax 256x1024", lambda p: p.output(p.softmax(p.input("x", x.shape), axis=-1)), [x],
         lambda v: np.exp(v - v.max(-1, keepdims=True)) / np.exp(v - v.max(-1, keepdims=True)).sum(-1, keepdims=True))
    case("reduce_sum 256x1024 axis 1", lambda p: p.output(p.reduce_sum(p.input("x", x.shape), axes=[1])), [x],
         lambda v: v.sum(axis=1))
    case("argsort 256x1024 (stable)", lambda p: p.output(p.argsort(p.input("x", x.shape), axis=-1)), [x],
         lambda v: np.argsort(v, axis=-1, kind="stable"))
    y = rng.standard_normal((1024, 1024), np.float32)
    case("add+relu 1024x1024", lambda p: p.output(p.relu(p.add(p.input("x", y.shape), p.input("y", y.shape)))),
         [y, y], lambda u, v: np.maximum(u + v, 0))

    def chain(p):
        v = p.input("x", (16,))
        for _ in range(20):
            v = p.neg(v)
        p.output(v)

    small = rng.standard_normal(16).astype(np.float32)

    def numpy_chain(v):
        for _ in range(20):
            v = -v
        return v

    case("20 dispatches, 16 elements (per run)", chain, [small], numpy_chain, unit_scale=1e6, unit="us")
    return rows
