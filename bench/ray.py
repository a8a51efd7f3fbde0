"""Remote devices on Ray (polyhal-ray), on a 3-node cluster started on this machine (127.0.0.1).

Rows, each polyhal beside what a Ray user would write instead, from the same run:

- a replayed remote plan, per step (one run + its completion): target <= 150 us median; anchors,
  their samples taken in turn with polyhal's: a Ray compiled graph to an actor doing the same
  work with numpy (its input sent each time, its result kept on the actor, as the plan's), an
  empty compiled-graph hop (what a step cannot go below: the ratio polyhal controls on a busy
  machine), and an ordinary Ray actor call doing the work;
- the first call of a compiled remote plan: target <= 2 ms; anchor the first execution of a
  freshly compiled Ray graph;
- upload and download of 64 MiB between this process and a node (GB/s): anchors ``ray.put`` read
  by an actor, and an actor's array read back with ``ray.get``;
- 64 MiB from one node to another (GB/s): target >= 80% of Ray's own object-store rate, measured
  beside it (an actor puts the array, another pulls it and copies it into an array of its own);
- a model split across a local and a remote device: its outputs must equal those on one device.

``python -m bench ray`` (``--quick`` for fewer repetitions). Without Ray the benchmark is
skipped (DeviceAbsent) and the recorded results stay.
"""

from __future__ import annotations

import gc
import os
import time

import numpy as np

from bench.harness import DeviceAbsent, Row

MIB = 1 << 20


def _program(device: str, n: int = 64):
    import polyhal

    b = polyhal.ProgramBuilder("step")
    x = b.input("x", (n, n))
    b.output(b.op("relu", b.op("add", x, x, affinity=device), affinity=device))
    return b.build()


def _mlp(first: str, second: str):
    import polyhal

    b = polyhal.ProgramBuilder("mlp")
    x, w = b.input("x", (256, 512)), b.input("w", (512, 512))
    h = b.op("relu", b.op("matmul", x, w, affinity=first), affinity=first)
    b.output(b.op("softmax", b.op("matmul", h, w, affinity=second), affinity=second))
    return b.build()


def interleaved(fns, *, repeat: int, warmup: int = 1) -> list[float]:
    """Median seconds per call of each of ``fns``, their samples taken in turn (polyhal's, then
    the anchor's, and again), so that both see the same load on a busy machine."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, samples):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [float(np.median(s)) for s in samples]


def run(args) -> list[Row]:
    try:
        import ray
        from ray.cluster_utils import Cluster
        from ray.dag import InputNode
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        from polyhal_ray.loopback import LOOPBACK, LOOPBACK_ENV, node_addresses, use_loopback
    except ImportError as exc:
        raise DeviceAbsent(f"Ray is not installed ({exc}); pip install -e plugins/ray") from exc
    use_loopback()  # every node on 127.0.0.1: nothing this benchmark sends leaves the machine
    os.environ["POLYHAL_BACKENDS"] = "cpu,ray"
    node_env = {**LOOPBACK_ENV, "POLYHAL_BACKENDS": "cpu", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    node_args = dict(num_cpus=1, include_dashboard=False, object_store_memory=400 * MIB, env_vars=node_env)
    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    nodes = [cluster.add_node(**node_args) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False, logging_level="error")
    try:
        if set(node_addresses().values()) != {LOOPBACK}:
            raise RuntimeError(f"a node of the benchmark's cluster is not on {LOOPBACK}: {node_addresses()}")
        return _measure(args, ray, nodes, InputNode, NodeAffinitySchedulingStrategy)
    finally:
        ray.shutdown()
        cluster.shutdown()


def _measure(args, ray, nodes, InputNode, Affinity) -> list[Row]:
    import polyhal
    from polyhal.hal.tensor import asarray, empty
    from polyhal.registry import Registry

    reps = 20 if args.quick else 200
    reg = Registry()
    a, b = (f"ray:{n.node_id[:8]}/cpu:0" for n in nodes)
    dev_a, dev_b = reg.get_device(a), reg.get_device(b)

    @ray.remote(num_cpus=0)
    class Echo:
        """What a Ray user's own actor would be: no work, so that the hop is all that is timed."""

        def hop(self, x):
            return x

        def add_relu(self, x):
            """The replayed plan's work, written by hand: the result stays on the actor."""
            self.out = np.maximum(x + x, 0)

        def produce(self):
            return [ray.put(self.array)]

        def make(self, nbytes):
            self.array = np.ones(nbytes, np.uint8)

        def give(self):
            return self.array

        def consume(self, wrapped):
            data = ray.get(wrapped[0])
            if getattr(self, "sink", None) is None or self.sink.shape != data.shape:
                self.sink = np.empty_like(data)
            np.copyto(self.sink, data)
            return data.nbytes

    echo = Echo.options(scheduling_strategy=Affinity(nodes[0].node_id, soft=False)).remote()
    echo_b = Echo.options(scheduling_strategy=Affinity(nodes[1].node_id, soft=False)).remote()
    ray.get([echo.hop.remote(0), echo_b.hop.remote(0)])

    rows: list[Row] = []
    load_before = os.getloadavg()
    # -- a replayed remote plan, and its first call --------------------------------------------
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    first_calls, first_graphs = [], []
    for _ in range(3 if args.quick else 5):
        plan = polyhal.compile(_program(a), registry=reg)
        t0 = time.perf_counter()
        out = plan(x)
        dev_a.synchronize()
        first_calls.append(time.perf_counter() - t0)
        np.testing.assert_allclose(out.numpy(), np.maximum(x + x, 0))
        del out
        with InputNode() as inp:
            dag = echo.hop.bind(inp)
        graph = dag.experimental_compile()
        t0 = time.perf_counter()
        graph.execute(1).get(timeout=60)
        first_graphs.append(time.perf_counter() - t0)
        graph.teardown()
    # One compiled graph per actor at a time (a second one on it hangs): the empty hop goes to
    # the actor on the other node.
    with InputNode() as inp:
        graph = echo.add_relu.bind(inp).experimental_compile()
    with InputNode() as inp:
        hop_graph = echo_b.hop.bind(inp).experimental_compile()

    def replayed():
        plan(x)
        dev_a.synchronize()

    step, by_graph, hop, by_call = interleaved(
        [replayed, lambda: graph.execute(x).get(timeout=60), lambda: hop_graph.execute(1).get(timeout=60),
         lambda: ray.get(echo.add_relu.remote(x))],
        repeat=reps, warmup=5)
    graph.teardown()
    hop_graph.teardown()
    us = 1e6
    first = float(np.median(first_calls))
    rows += [
        Row("replayed remote plan step (add+relu 64x64, run + completion)", "us", step * us, by_graph * us,
            "Ray compiled graph to an actor doing the same with numpy", "<= 150 us median", step * us <= 150,
            {"empty_compiled_graph_hop_us": hop * us, "ordinary_actor_call_us": by_call * us}),
        Row("replayed remote plan step vs Ray's empty compiled-graph hop", "us", step * us, hop * us,
            "an empty Ray compiled-graph hop (what polyhal adds above it is polyhal's)"),
        Row("replayed remote plan step vs an ordinary Ray actor call", "us", step * us, by_call * us,
            "ray.get(actor.add_relu.remote(x)), the same work"),
        Row("first call of a compiled remote plan", "ms", first * 1e3, float(np.median(first_graphs)) * 1e3,
            "first execute of a fresh Ray compiled graph", "<= 2 ms", first * 1e3 <= 2,
            {"samples_ms": [round(t * 1e3, 3) for t in first_calls]}),
    ]
    del plan
    gc.collect()

    # -- upload / download between this process and a node --------------------------------------
    nbytes = 64 * MIB
    host = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    t = asarray(host, np.uint8, dev_a)
    dev_a.synchronize()
    back = np.empty_like(host)
    n = 3 if args.quick else 15

    def upload():
        dev_a.write(t.buffer, 0, host)
        dev_a.synchronize()

    def download():
        dev_a.read(t.buffer, 0, back)

    ray.get(echo.make.remote(nbytes))
    up, ray_up = interleaved([upload, lambda: ray.get(echo.consume.remote([ray.put(host)]))], repeat=n)
    down, ray_down = interleaved([download, lambda: np.copyto(back, ray.get(echo.give.remote()))], repeat=n)
    download()
    assert np.array_equal(back, host)
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    rows += [
        Row("upload 64 MiB to a node", "GB/s", gbs(up), gbs(ray_up), "ray.put + actor ray.get + copy"),
        Row("download 64 MiB from a node", "GB/s", gbs(down), gbs(ray_down),
            "ray.get of an actor's array, copied into the caller's"),
    ]

    # -- node to node -------------------------------------------------------------------------
    dst = empty(host.shape, np.uint8, dev_b)

    def node_to_node():
        dev_a.transfer(dev_a, t.native, dev_b, dst.native, nbytes)
        dev_b.synchronize()

    n2n, ray_n2n = interleaved([node_to_node, lambda: ray.get(echo_b.consume.remote(echo.produce.remote()))],
                               repeat=n)
    assert np.array_equal(dst.numpy(), host)
    ratio = gbs(n2n) / gbs(ray_n2n)
    rows.append(Row("64 MiB node to node", "GB/s", gbs(n2n), gbs(ray_n2n),
                    "Ray object store: actor ray.put, other actor ray.get + copy", ">= 80% of Ray's rate",
                    ratio >= 0.8, {"fraction_of_ray": round(ratio, 3)}))
    del t, dst
    gc.collect()

    # -- a model split across a local and a remote device --------------------------------------
    rng = np.random.default_rng(2)
    xs = rng.standard_normal((256, 512)).astype(np.float32)
    ws = (rng.standard_normal((512, 512)) / 16).astype(np.float32)
    one = polyhal.compile(_mlp("cpu:0", "cpu:0"), registry=reg)
    split = polyhal.compile(_mlp("cpu:0", a), registry=reg)
    want, got = one.run_numpy(xs, ws)[0], split.run_numpy(xs, ws)[0]
    diff = float(np.abs(want - got).max())
    t_split, t_one = interleaved([lambda: split.run_numpy(xs, ws), lambda: one.run_numpy(xs, ws)], repeat=max(n, 5))
    busy = {"load_average_1min": [round(load_before[0], 1), round(os.getloadavg()[0], 1)], "cores": os.cpu_count()}
    for row in rows:
        row.extra.update(busy)  # the machine is shared: say how busy it was
    rows.append(Row("MLP split cpu:0 + remote node (outputs as on one device)", "ms", t_split * 1e3, t_one * 1e3,
                    "the same plan on cpu:0 alone", "max |diff| <= 1e-5", diff <= 1e-5,
                    {"max_abs_diff": diff, **busy}))
    return rows
