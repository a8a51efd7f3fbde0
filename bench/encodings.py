"""Data tiling: a chain of 4 matmuls compiled with ``data_tiling=True`` beside the same program
without encodings — dispatches, pack/unpack dispatches, bytes moved and time.

Targets (encodings issue):

* On a device without data tiling — here a second CPU device with tiling disabled
  (``POLYHAL_CPU_DEVICES=2 POLYHAL_CPU_DATA_TILING=cpu:0``: cpu:1's resolver answers the
  identity layout), and the OpenCL device when one is installed (it has no resolver at all: the
  core's identity resolver answers) — the encoded program has 0 encode dispatches, moves the
  same bytes as the un-encoded one, and runs within 1.02x of its time. (A CPU device is the
  timed one because both plans are then the very same numpy calls, so the ratio measures
  polyhal and not the OpenCL driver's jitter.)
* On the CPU tiled layout (cpu:0): one pack per chain input and one unpack per chain output
  (6) instead of one per matmul operand and result (12), and results equal to numpy's within
  float32 tolerance. Its time is reported beside the un-encoded program's, with the weights as
  inputs (packed on every run) and as constants (packed once, at compile time).
"""

from __future__ import annotations

import os
import statistics
from unittest.mock import patch

import numpy as np

import polyhal
from bench.harness import Row, median_time
from polyhal.passes.materialize_encoding import traffic
from polyhal.registry import Registry

M, D, LINKS = 256, 512, 4


def _chain(weights: list[np.ndarray] | None = None) -> polyhal.Program:
    b = polyhal.ProgramBuilder("chain4")
    v = b.input("x", (M, D))
    for i in range(LINKS):
        w = b.input(f"w{i}", (D, D)) if weights is None else b.constant(weights[i], f"w{i}")
        v = b.matmul(v, w)
    b.output(v)
    return b.build()


def _paired_times(plan_a, plan_b, feeds, device, *, rounds: int, number: int) -> tuple[float, float]:
    """Median seconds per run of two plans, sampled in alternation so that drift hits both."""
    out_a = polyhal.empty((M, D), "float32", device)
    out_b = polyhal.empty((M, D), "float32", device)
    ta, tb = [], []
    for r in range(rounds):
        pairs = [(plan_a, out_a, ta), (plan_b, out_b, tb)]
        for plan, out, acc in (pairs if r % 2 == 0 else pairs[::-1]):
            acc.append(median_time(lambda: plan(*feeds, out=out), repeat=1, number=number, warmup=1))
    return statistics.median(ta), statistics.median(tb)


def _encode_dispatches(plan) -> int:
    return plan.placement.encodings.encode_dispatches


def run(args) -> list[Row]:
    # Two CPU devices, cpu:0 tiles and cpu:1 does not; the registry is this benchmark's own.
    with patch.dict(os.environ, POLYHAL_CPU_DEVICES="2", POLYHAL_CPU_DATA_TILING="cpu:0"):
        registry = Registry()
        registry.device_specs()
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal((M, D), np.float32)] + \
        [(rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32) for _ in range(LINKS)]
    want = feeds[0].astype(np.float64)
    for w in feeds[1:]:
        want = want @ w
    rounds, number = (15, 5) if args.quick else (41, 5)
    program = _chain()
    rows: list[Row] = []

    # -- a device without data tiling: everything folds ---------------------------------------------
    untiled = ["cpu:1"] + [s.name for s in registry.device_specs() if s.backend == "opencl"][:1]
    for device in untiled:
        dense = polyhal.compile(program, device, registry=registry)
        tiled = polyhal.compile(program, device, registry=registry, data_tiling=True)
        td, tt = traffic(dense.program), traffic(tiled.program)
        report = tiled.placement.encodings
        note = {"encode_ops": len(report.encodes), "folded": report.folded,
                "resolved_by": sorted({r.plugin for r in report.resolutions})}
        rows.append(Row(f"{device} (no data tiling): encode dispatches", "dispatches",
                        _encode_dispatches(tiled), 0, "un-encoded program", "0",
                        _encode_dispatches(tiled) == 0, note))
        rows.append(Row(f"{device} (no data tiling): dispatches", "dispatches", tt.dispatches, td.dispatches,
                        "un-encoded program", "same", tt.dispatches == td.dispatches))
        rows.append(Row(f"{device} (no data tiling): bytes moved", "B", tt.bytes_moved, td.bytes_moved,
                        "un-encoded program", "same", tt.bytes_moved == td.bytes_moved,
                        {"intermediate_bytes": [tt.intermediate_bytes, td.intermediate_bytes]}))
        if device.startswith("cpu"):
            t_dense, t_tiled = _paired_times(dense, tiled, feeds, registry.get_device(device),
                                             rounds=rounds, number=number)
            got = tiled(*feeds).numpy()
            assert np.allclose(got, want, rtol=1e-3, atol=1e-3), "untiled chain is wrong"
            rows.append(Row(f"{device} (no data tiling): 4-matmul chain {M}x{D}, time", "ms", t_tiled * 1e3,
                            t_dense * 1e3, "un-encoded program", "<= 1.02x", t_tiled <= 1.02 * t_dense))

    # -- the CPU tiled layout ----------------------------------------------------------------------
    dense = polyhal.compile(program, "cpu:0", registry=registry)
    tiled = polyhal.compile(program, "cpu:0", registry=registry, data_tiling=True)
    names = [op.name for op in tiled.program.ops]
    packs, unpacks = names.count("pack"), names.count("unpack")
    report = tiled.placement.encodings
    per_matmul = 3 * LINKS  # what materializing every encode op separately would dispatch
    rows.append(Row("cpu:0 tiled: pack + unpack dispatches", "dispatches", packs + unpacks, per_matmul,
                    "one pack per operand, one unpack per result", "5 packs + 1 unpack",
                    (packs, unpacks) == (LINKS + 1, 1),
                    {"packs": packs, "unpacks": unpacks, "mmt4d": names.count("mmt4d"),
                     "encode_ops": len(report.encodes), "folded": report.folded}))
    td, tt = traffic(dense.program), traffic(tiled.program)
    rows.append(Row("cpu:0 tiled: bytes moved", "B", tt.bytes_moved, td.bytes_moved, "un-encoded program",
                    extra={"dispatches": [tt.dispatches, td.dispatches]}))
    got = tiled(*feeds).numpy()
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    rows.append(Row("cpu:0 tiled: max |error| / max |numpy| (float64 numpy)", "", err,
                    float(np.max(np.abs(dense(*feeds).numpy() - want)) / np.max(np.abs(want))),
                    "un-encoded program", "<= 1e-5", err <= 1e-5))
    t_dense, t_tiled = _paired_times(dense, tiled, feeds, registry.get_device("cpu:0"), rounds=rounds, number=number)
    rows.append(Row(f"cpu:0 tiled: 4-matmul chain {M}x{D}, weights as inputs, time", "ms", t_tiled * 1e3,
                    t_dense * 1e3, "un-encoded program"))
    constant = _chain(feeds[1:])
    dense_c = polyhal.compile(constant, "cpu:0", registry=registry)
    tiled_c = polyhal.compile(constant, "cpu:0", registry=registry, data_tiling=True)
    t_dense, t_tiled = _paired_times(dense_c, tiled_c, feeds[:1], registry.get_device("cpu:0"),
                                     rounds=rounds, number=number)
    names = [op.name for op in tiled_c.program.ops]
    rows.append(Row(f"cpu:0 tiled: 4-matmul chain {M}x{D}, constant weights (packed at compile time), time", "ms",
                    t_tiled * 1e3, t_dense * 1e3, "un-encoded program",
                    extra={"packs": names.count("pack"), "unpacks": names.count("unpack"),
                           "constant_packs": tiled_c.placement.encodings.constant_packs}))
    return rows
