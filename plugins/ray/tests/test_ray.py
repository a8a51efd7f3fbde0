"""The Ray backend on a real multi-node cluster on this machine (``ray.cluster_utils.Cluster``),
every node on 127.0.0.1: one cluster for the module (starting nodes costs seconds each).

Nodes: the head, node ``a`` (its allocator limited to 256 MiB, for a real out-of-memory on a
node), and, in the tests that need them, a node that dies and a node with another polyhal.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install polyhal-ray pulls it in)")
cluster_utils = pytest.importorskip("ray.cluster_utils")

import polyhal  # noqa: E402
from polyhal.errors import KernelNotFoundError, OutOfMemoryError  # noqa: E402
from polyhal.hal.queue import Semaphore  # noqa: E402
from polyhal.hal.tensor import asarray, empty  # noqa: E402
from polyhal.registry import Registry  # noqa: E402

import polyhal_ray.plugin as ray_plugin  # noqa: E402
from polyhal_ray import NodeLostError  # noqa: E402
from polyhal_ray.cluster import short_id  # noqa: E402
from polyhal_ray.worker import REPLAY  # noqa: E402
from polyhal_ray.loopback import LOOPBACK, LOOPBACK_ENV, node_addresses, use_loopback  # noqa: E402

#: What the nodes' runtimes load: the CPU backend and the template backend (a device with two
#: kernels); every node on 127.0.0.1 (no test traffic leaves the machine), without Ray's token auth.
NODE_ENV = {"POLYHAL_BACKENDS": "cpu,mydev", **LOOPBACK_ENV}


def node_args(**env: str) -> dict:
    return dict(num_cpus=1, include_dashboard=False, object_store_memory=200 << 20,
                env_vars={**NODE_ENV, "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **env})


@pytest.fixture(scope="module")
def cluster(template_site):
    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process by another test")
    # The nodes' runtimes see the backend template (installed into a folder of the test session's,
    # never into the user's environment) through their PYTHONPATH.
    env = pytest.MonkeyPatch()
    for k, v in LOOPBACK_ENV.items():
        env.setenv(k, v)
    use_loopback()  # (ray is imported: the variable alone would come too late)
    env.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(template_site), os.environ.get("PYTHONPATH")) if p))
    c = cluster_utils.Cluster(initialize_head=True, head_node_args=node_args())
    c.node_a = c.add_node(**node_args(POLYHAL_ALLOCATOR="limit=256MiB"))
    ray.init(address=c.address, log_to_driver=False, logging_level="error")
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        ray_plugin._cluster = None
        env.undo()


@pytest.fixture
def registry(cluster, monkeypatch):
    monkeypatch.setenv("POLYHAL_BACKENDS", "cpu,ray")
    return Registry()


def remote(registry, node, device="cpu:0"):
    return f"ray:{short_id(node.node_id)}/{device}"


def mlp(first: str, second: str):
    b = polyhal.ProgramBuilder("mlp")
    x, w = b.input("x", (32, 64)), b.input("w", (64, 64))
    h = b.op("relu", b.op("matmul", x, w, affinity=first), affinity=first)
    b.output(b.op("softmax", b.op("matmul", h, w, affinity=second), affinity=second))
    return b.build()


DATA = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32), \
    (np.random.default_rng(1).standard_normal((64, 64)) / 8).astype(np.float32)


def stats(registry, name):
    """What is resident on the node of device ``name``, once everything sent (frees too) ran."""
    session = registry.get_device(name).session
    session.wait(session.flush())
    return ray.get(session.actor.statistics.remote())


def on_loopback() -> None:
    """Every node of the cluster, and this driver, are on 127.0.0.1."""
    assert set(node_addresses().values()) == {LOOPBACK}, node_addresses()
    assert ray.util.get_node_ip_address() == LOOPBACK


def test_every_node_is_on_the_loopback_address(cluster):
    on_loopback()
    assert cluster.address.startswith(f"{LOOPBACK}:")  # the head's GCS
    assert len(node_addresses()) >= 2


def test_every_node_registers_its_devices_below_local_ones(registry, cluster):
    specs = registry.device_specs()
    names = [s.name for s in specs]
    for node in (cluster.head_node, cluster.node_a):
        for device in ("cpu:0", "mydev:0"):
            assert remote(registry, node, device) in names
    assert names[0] == "cpu:0"  # local devices first
    spec = registry.spec(remote(registry, cluster.node_a))
    assert spec.backend == "ray" and spec.rank < min(s.rank for s in specs if s.backend != "ray")
    assert "matmul" in spec.kernel_names and "remote" in spec.capabilities
    assert not (spec.heaps[0].memory_type & polyhal.MemoryType.HOST_VISIBLE)
    assert registry.spec(remote(registry, cluster.node_a, "mydev:0")).kernel_names == frozenset({"add", "relu"})


def test_tensors_stay_on_the_node_until_read(registry, cluster):
    device = registry.get_device(remote(registry, cluster.node_a))
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    before = stats(registry, device.name)["buffers"]
    t = asarray(x, None, device)
    np.testing.assert_array_equal(t.numpy(), x)
    assert stats(registry, device.name)["buffers"] == before + 1
    with pytest.raises(polyhal.DLPackError, match="Ray node"):
        t.__dlpack__()
    big = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: uploaded through the object store
    np.testing.assert_array_equal(asarray(big, None, device).numpy(), big)
    del t
    gc.collect()
    assert stats(registry, device.name)["buffers"] == before


def test_remote_plan_replays_through_a_compiled_graph(registry, cluster):
    name = remote(registry, cluster.node_a)
    want = polyhal.compile(mlp("cpu:0", "cpu:0"), registry=registry).run_numpy(*DATA)[0]
    before = stats(registry, name)
    plan = polyhal.compile(mlp(name, name), registry=registry)
    assert plan.replay is not None and registry.get_device(name).session._graph is not None
    assert stats(registry, name)["programs"] == before["programs"] + 1  # recorded on the node once
    for _ in range(3):
        out = plan(*DATA)
        assert out.device.name == name  # the result stays on the node until read
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    # A run is one submission, through the compiled graph: one execute, no other actor call.
    session = registry.get_device(name).session
    graph, executes, sent = session._graph, [], session._seq
    execute = graph.execute
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graph, "execute", lambda *a: executes.append(a) or execute(*a), raising=False)
        for _ in range(3):
            out = plan(*DATA)
    assert session._seq == sent + 3 and len(executes) == 3
    assert [c[0] for c in executes[-1][0][1]][-1] == REPLAY  # the run's upload, allocation, then its replay
    # Inputs already on the node, and outputs the caller gives: other tensors bound to the same replay.
    device = registry.get_device(name)
    x, w = (asarray(a, None, device) for a in DATA)
    given = empty(want.shape, want.dtype, device)
    assert plan(x, w, out=given) is given
    np.testing.assert_allclose(given.numpy(), want, rtol=1e-5, atol=1e-6)
    session = device.session
    del plan, out, x, w, given, device
    gc.collect()
    after = stats(registry, name)
    assert (after["programs"], after["buffers"], after["kernels"]) == \
        (before["programs"], before["buffers"], before["kernels"])  # forgotten with the plan
    deadline = time.monotonic() + 30  # the graph (and its polling loop) goes soon after the last replayed plan
    while session._graph is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session._graph is None


@pytest.mark.parametrize("split", ["local-remote", "remote-local", "node-node"])
def test_a_model_split_across_devices_gives_the_single_device_outputs(registry, cluster, split):
    a, head = remote(registry, cluster.node_a), remote(registry, cluster.head_node)
    first, second = {"local-remote": ("cpu:0", a), "remote-local": (a, "cpu:0"), "node-node": (head, a)}[split]
    want = polyhal.compile(mlp("cpu:0", "cpu:0"), registry=registry).run_numpy(*DATA)[0]
    plan = polyhal.compile(mlp(first, second), registry=registry)
    if split == "node-node":
        assert "through Ray's object store" in plan.explain()
    for _ in range(2):
        np.testing.assert_allclose(plan.run_numpy(*DATA)[0], want, rtol=1e-5, atol=1e-6)


def test_queue_submissions_complete_through_semaphores(registry, cluster):
    device = registry.get_device(remote(registry, cluster.node_a))
    queue = device.queues[0]
    t, u = empty((16,), np.uint8, device), empty((16,), np.uint8, device)
    filled, copied = Semaphore(0, "filled"), Semaphore(0, "copied")
    queue.fill(t.buffer, 0, 16, b"\x07", signal=[(filled, 1)])
    queue.copy(t.buffer, 0, u.buffer, 0, 16, wait=[(filled, 1)], signal=[(copied, 1)])
    copied.wait(1, timeout=60)  # signalled by the node's answer, on the completion thread
    np.testing.assert_array_equal(u.numpy(), 7)


def test_the_cost_policy_sees_measured_links_to_and_between_nodes(registry, cluster):
    from polyhal.policies.cost import link_bandwidth

    local, a, head = (registry.spec(n) for n in ("cpu:0", remote(registry, cluster.node_a),
                                                 remote(registry, cluster.head_node)))
    for src, dst in ((local, a), (a, local), (head, a)):
        value, source = link_bandwidth(registry, src, dst)
        assert 0 < value < float("inf") and source == "declared by ray", (src.name, dst.name, value, source)
    assert link_bandwidth(registry, local, a)[0] == link_bandwidth(registry, local, a)[0]  # measured once
    assert link_bandwidth(registry, a, registry.spec(remote(registry, cluster.node_a, "mydev:0")))[1] != \
        "declared by ray"  # two devices of one node: the node's own business


def test_an_op_a_node_has_no_kernel_for_is_refused_at_compile(registry, cluster):
    mydev = remote(registry, cluster.node_a, "mydev:0")
    with pytest.raises(KernelNotFoundError, match="matmul"):
        polyhal.compile(mlp(mydev, mydev), registry=registry)


def test_out_of_memory_on_a_node_names_node_and_device(registry, cluster):
    name = remote(registry, cluster.node_a)
    device = registry.get_device(name)
    before = stats(registry, name)["buffers"]
    with pytest.raises(OutOfMemoryError) as info:  # the node's allocator is limited to 256 MiB
        device.allocator.allocate(300 << 20)
    message = str(info.value)
    assert short_id(cluster.node_a.node_id) in message and "cpu:0" in message
    assert device.allocator.statistics.live_count == 0 or stats(registry, name)["buffers"] == before
    np.testing.assert_array_equal(asarray(np.ones(4, np.float32), None, device).numpy(), 1)  # still works


def test_an_unreachable_address_is_a_clear_reason_and_local_devices_stay(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(POLYHAL_RAY_ADDRESS="127.0.0.1:9", POLYHAL_BACKENDS="cpu,ray", POLYHAL_RAY_CONNECT_TIMEOUT="2")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from polyhal.registry import Registry
        r = Registry()
        print([s.name for s in r.device_specs()])
        print(r.unavailable_reasons())
        """)], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "['cpu:0']" in out.stdout
    assert "no Ray cluster answers at POLYHAL_RAY_ADDRESS=127.0.0.1:9" in out.stdout


def test_a_node_with_another_polyhal_is_left_out_naming_both_versions(cluster, tmp_path, monkeypatch):
    skew = tmp_path / "site"
    (skew / "polyhal-9.9.9.dist-info").mkdir(parents=True)
    (skew / "polyhal-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: polyhal\nVersion: 9.9.9\n")
    node = cluster.add_node(**node_args(PYTHONPATH=f"{skew}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
    try:
        on_loopback()
        monkeypatch.setenv("POLYHAL_BACKENDS", "cpu,ray")
        with pytest.warns(RuntimeWarning, match="9.9.9"):
            reg = Registry()
            names = [s.name for s in reg.device_specs()]
        assert not any(short_id(node.node_id) in n for n in names)
        assert any(n.startswith("ray:") for n in names)  # the other nodes are there
        (reason,) = [r for r in reg.unavailable_reasons()["ray"] if short_id(node.node_id) in r]
        assert "polyhal 9.9.9 on the node" in reason and f"{polyhal.__version__} here" in reason
    finally:
        cluster.remove_node(node)


def test_a_node_lost_mid_run_names_it_and_the_others_go_on(cluster, monkeypatch):
    victim = cluster.add_node(**node_args())
    on_loopback()
    monkeypatch.setenv("POLYHAL_BACKENDS", "cpu,ray")
    reg = Registry()
    lost, a = remote(reg, victim), remote(reg, cluster.node_a)
    assert lost in reg.default_devices()
    baseline = stats(reg, a)
    plan = polyhal.compile(mlp(lost, a), registry=reg)  # node to node: the victim feeds node a
    want = polyhal.compile(mlp("cpu:0", "cpu:0"), registry=reg).run_numpy(*DATA)[0]
    np.testing.assert_allclose(plan.run_numpy(*DATA)[0], want, rtol=1e-5, atol=1e-6)

    cluster.remove_node(victim)
    with pytest.raises(NodeLostError) as info:
        for _ in range(3):  # the loss may be noticed at the next submission or at the read
            plan.run_numpy(*DATA)
    assert info.value.node == short_id(victim.node_id) and short_id(victim.node_id) in str(info.value)

    # Work submitted to the lost node's queue fails its semaphores with the loss.
    after = Semaphore(0, "after")
    with pytest.raises(NodeLostError):
        reg.get_device(lost).queues[0].execute([], signal=[(after, 1)])
    with pytest.raises(polyhal.SemaphoreFailedError, match="was lost"):
        after.wait(1, timeout=5)

    # Node a goes on, and keeps nothing of the failed runs once the plan is gone.
    survivor = polyhal.compile(mlp(a, a), registry=reg)
    np.testing.assert_allclose(survivor.run_numpy(*DATA)[0], want, rtol=1e-5, atol=1e-6)
    del plan, survivor, info  # (the error's traceback holds the failed run's frames, the plan with them)
    gc.collect()
    after = stats(reg, a)
    assert (after["buffers"], after["kernels"]) == (baseline["buffers"], baseline["kernels"])

    # Later compiles leave the lost node out, in this registry and in new ones.
    assert lost not in reg.default_devices()
    assert lost not in [s.name for s in Registry().device_specs()]
    assert "was lost" in " ".join(Registry().unavailable_reasons().get("ray", []))


@pytest.mark.parametrize("dtype", ["float32", "bool", "int8", "bfloat16", "float8_e4m3fn"])
def test_a_replay_names_every_element_type_exactly(dtype):
    """A replay sends a numpy dtype as its string; ml_dtypes' types, whose string (``|V2``) says
    nothing, go as they are (the conformance suite's bfloat16 casts found it)."""
    from polyhal.ir.types import as_dtype
    from polyhal_ray.device import _wire_key

    t = np.dtype(as_dtype(dtype))
    sent = _wire_key((1, 0, (2, 3), t, (3, 1)))
    assert np.dtype(sent[3]) == t and sent[:3] == (1, 0, (2, 3)) and sent[4] == (3, 1)
