"""HIP queues and GPU-to-GPU transfers -- on FakeHipRuntime (a stand-in, not ROCm): the event
calls a HIPQueue makes, cross-queue waits on the device, peer copies and staging (with the path
explain names). The real-runtime calls (hipEventQuery, hipDeviceCanAccessPeer) are checked
where ROCm answers without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.hal.queue import Semaphore
from polyhal.hal.transfer import route
from polyhal_hip.errors import HipError, HipNoDevice
from polyhal_hip.queue import HIPQueue

from fake_runtime import gpu


@pytest.fixture
def two_gpus(make_fake, monkeypatch):
    """A registry over a stand-in runtime with two GPUs (``peer`` says whether they reach each other)."""
    from polyhal.registry import Registry, set_default_registry

    def make(peer: bool, slow_events: bool = False):
        rt = make_fake(devices=[gpu(0), gpu(1)], peer=peer, slow_events=slow_events)
        monkeypatch.setenv("POLYHAL_BACKENDS", "hip,cpu")
        monkeypatch.setenv("POLYHAL_HIP_CACHE_DIR", "off")
        reg = Registry()
        olds.append(set_default_registry(reg))
        return rt, reg.get_device("hip:0"), reg.get_device("hip:1")

    olds = []
    yield make
    if olds:
        set_default_registry(olds[0])


def test_hip_queue_signals_with_recorded_events(fake, fake_device):
    q = fake_device.queues[0]
    assert isinstance(q, HIPQueue) and q.asynchronous and fake_device.concurrent_queue is q
    sem = q.semaphore(0, "done")
    ran = []
    q.execute([lambda: ran.append(1)], signal=[(sem, 1)])
    assert ran == [1]
    assert fake.calls[-2:] == ["hipEventCreateWithFlags", "hipEventRecord"]
    sem.wait(1, timeout=5)  # host wait: hipEventQuery says it is done
    assert sem.value == 1


def test_hip_queue_waits_for_another_hip_queue_on_the_device(two_gpus):
    rt, a, b = two_gpus(peer=True, slow_events=True)
    sa = a.queues[0].semaphore(0, "a")
    a.queues[0].execute([lambda: None], signal=[(sa, 1)])
    syncs = rt.event_syncs
    b.queues[0].execute([lambda: None], wait=[(sa, 1)])
    assert rt.waits and rt.waits[-1][0] == rt.handle(b.stream)  # hipStreamWaitEvent ...
    assert rt.event_syncs == syncs and b.queues[0].deferred == 0  # ... and no host wait
    sa.wait(1, timeout=5)
    assert rt.event_syncs == syncs + 1 and sa.value == 1


def test_hip_queue_defers_a_wait_on_host_work_to_its_issue_thread(fake, fake_device):
    q = fake_device.queues[0]
    host = Semaphore(0, "cpu:0/part")
    done = q.semaphore(0, "done")
    ran = []
    q.execute([lambda: ran.append(1)], wait=[(host, 1)], signal=[(done, 1)])
    assert ran == [] and q.deferred == 1  # returned at once; the CPU has not signalled
    host.signal(1)
    done.wait(1, timeout=5)
    assert ran == [1]


def test_peer_copy_between_two_hip_gpus(two_gpus):
    rt, a, b = two_gpus(peer=True)
    x = polyhal.asarray(np.arange(64, dtype=np.float32), device=a)
    r = route(a, b)
    assert r.by is b and r.how == "peer copy" and r.direction == "device to device"
    y = x.to_device(b)
    assert "hipMemcpyPeerAsync" in rt.calls and rt.peers_enabled == [(1, 0)]
    np.testing.assert_array_equal(y.numpy(), np.arange(64, dtype=np.float32))


def test_no_peer_access_is_staged_through_pinned_host_memory_and_explained(two_gpus):
    rt, a, b = two_gpus(peer=False)
    r = route(a, b)
    assert r.how == "staged through pinned host memory (no peer access)"
    assert "staged through pinned host memory (no peer access)" in r.explain(256)
    x = polyhal.asarray(np.arange(64, dtype=np.float32), device=a)
    y = x.to_device(b)
    assert "hipMemcpyPeerAsync" not in rt.calls and "hipHostMalloc" in rt.calls
    assert not rt.live("host")  # the staging buffer went back
    np.testing.assert_array_equal(y.numpy(), np.arange(64, dtype=np.float32))


def test_real_runtime_answers_the_queue_and_peer_calls_without_a_gpu(real_runtime):
    """ROCm here has no GPU: the calls exist and fail with the runtime's own status."""
    with pytest.raises((HipNoDevice, HipError)):
        real_runtime.device_can_access_peer(0, 1)
    with pytest.raises((HipNoDevice, HipError)):
        real_runtime.event_create()
