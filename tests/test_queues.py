"""HAL queues, timeline semaphores and cross-device transfers (polyhal.hal.queue, polyhal.hal.transfer)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import polyhal
from polyhal.errors import DeviceNotFoundError, OutOfMemoryError, SemaphoreFailedError, SemaphoreTimeoutError
from polyhal.hal.adaptors import LimitingAdaptor, set_device_allocator
from polyhal.hal.queue import HostThreadQueue, InlineQueue, Queue, Semaphore
from polyhal.hal.transfer import route


def _opencl():
    try:
        return polyhal.get_device("opencl:0")
    except polyhal.PolyhalError as exc:
        pytest.skip(f"no OpenCL device: {exc}")


# -- semaphores ------------------------------------------------------------------------------------

def test_semaphore_host_wait_is_released_by_a_signal_from_another_thread():
    sem = Semaphore(0, "test/ready")
    seen = []

    def waiter():
        sem.wait(2, timeout=10)
        seen.append(sem.value)

    t = threading.Thread(target=waiter)
    t.start()
    sem.signal(1)  # not enough: the waiter keeps waiting
    time.sleep(0.05)
    assert seen == [] and t.is_alive()
    sem.signal(3)
    t.join(10)
    assert seen == [3]
    sem.wait(1, timeout=0)  # already reached: returns at once


def test_semaphore_values_only_grow():
    sem = Semaphore(5, "test/s")
    with pytest.raises(ValueError, match="below its value 5"):
        sem.signal(4)
    sem.signal(5)
    assert sem.value == 5


def test_wait_nothing_satisfies_times_out_with_names_and_values():
    queue = InlineQueue(polyhal.get_device("cpu:0"))
    sem = queue.semaphore(1, "never")
    start = time.perf_counter()
    with pytest.raises(SemaphoreTimeoutError) as info:
        sem.wait(7, timeout=0.05)
    assert time.perf_counter() - start < 5
    msg = str(info.value)
    assert "cpu:0/queue0/never" in msg and "value 7" in msg and "is at 1" in msg
    assert info.value.semaphore == "cpu:0/queue0/never" and info.value.value == 7


def test_queue_submission_waiting_on_an_unsignalled_value_ends_with_an_error():
    queue = InlineQueue(polyhal.get_device("cpu:0"), timeout=0.05)
    gate, done = queue.semaphore(0, "gate"), queue.semaphore(0, "done")
    ran = []
    with pytest.raises(SemaphoreTimeoutError, match="cpu:0/queue0/gate"):
        queue.execute([lambda: ran.append(1)], wait=[(gate, 1)], signal=[(done, 1)])
    assert ran == []
    with pytest.raises(SemaphoreFailedError, match="cpu:0/queue0/done"):  # its signal carries the failure
        done.wait(1, timeout=1)


def test_failed_semaphore_reaches_every_waiter():
    sem = Semaphore(0, "test/failing")
    errors = []

    def waiter():
        try:
            sem.wait(1, timeout=10)
        except SemaphoreFailedError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    cause = RuntimeError("kernel blew up")
    sem.fail(cause)
    for t in threads:
        t.join(10)
    assert len(errors) == 3 and all(e.__cause__ is cause and "kernel blew up" in str(e) for e in errors)
    with pytest.raises(SemaphoreFailedError):  # a later waiter too, whatever the value
        sem.wait(0, timeout=0)
    sem.signal(9)  # ignored once failed
    assert sem.failure is cause


# -- queues ----------------------------------------------------------------------------------------

def test_device_has_an_inline_queue_by_default():
    dev = polyhal.get_device("cpu:0")
    assert len(dev.queues) == 1 and isinstance(dev.queues[0], InlineQueue)
    assert isinstance(dev.queues[0], Queue) and dev.queues is dev.queues


def test_inline_queue_runs_in_submission_order_and_signals():
    queue = polyhal.get_device("cpu:0").queues[0]
    sem = queue.semaphore()
    order = []
    queue.execute([lambda: order.append("a"), lambda: order.append("b")], signal=[(sem, 1)])
    queue.execute([lambda: order.append("c")], wait=[(sem, 1)], signal=[(sem, 2)])
    assert order == ["a", "b", "c"] and sem.value == 2


def test_inline_queue_copy_fill_alloca_dealloca():
    dev = polyhal.get_device("cpu:0")
    queue = dev.queues[0]
    sem = queue.semaphore()
    a = queue.alloca(16, signal=[(sem, 1)])
    b = queue.alloca(16, signal=[(sem, 2)])
    queue.fill(a, 0, 16, b"\x01\x02\x03\x04", wait=[(sem, 2)], signal=[(sem, 3)])
    queue.copy(a, 4, b, 0, 8, wait=[(sem, 3)], signal=[(sem, 4)])
    assert bytes(b.map()[:8]) == b"\x01\x02\x03\x04" * 2
    with pytest.raises(ValueError, match="pattern"):
        queue.fill(a, 0, 15, b"\x01\x02")
    queue.dealloca(a, wait=[(sem, 4)], signal=[(sem, 5)])
    assert a.released and sem.value == 5


def test_thread_queue_runs_in_order_off_the_host_thread_and_fails_dependents():
    queue = HostThreadQueue(polyhal.get_device("cpu:0"), timeout=5)
    try:
        host = queue.semaphore(0, "host")
        done = queue.semaphore(0, "done")
        order, threads = [], []
        queue.execute([lambda: (order.append(1), threads.append(threading.current_thread()))],
                      wait=[(host, 1)], signal=[(done, 1)])
        queue.execute([lambda: order.append(2)], wait=[(done, 1)], signal=[(done, 2)])
        assert order == []  # submitted, waiting for the host's signal
        host.signal(1)
        done.wait(2, timeout=5)
        assert order == [1, 2] and threads[0] is not threading.current_thread()

        def boom():
            raise ZeroDivisionError("step 3")

        queue.execute([boom], signal=[(done, 3)])
        queue.execute([lambda: order.append(4)], wait=[(done, 3)], signal=[(done, 4)])
        with pytest.raises(SemaphoreFailedError, match="step 3"):
            done.wait(4, timeout=5)
        assert order == [1, 2]
    finally:
        queue.close()


# -- transfers -------------------------------------------------------------------------------------

def test_cpu_to_opencl_and_back_through_the_backend_capability():
    cl, cpu = _opencl(), polyhal.get_device("cpu:0")
    assert cl.can_copy(cpu, cl) and cl.can_copy(cl, cpu) and not cpu.can_copy(cpu, cl)
    assert route(cpu, cl).explain(4096) == "cpu:0 -> opencl:0, 4096 B, by opencl (enqueue_copy)"
    x = np.arange(1024, dtype=np.float32)
    t = polyhal.asarray(x, device=cpu).to_device(cl)
    assert t.device is cl
    back = t.to_device("cpu:0")
    assert back.device is cpu and np.array_equal(back.numpy(), x)
    assert t.to_device(cl) is t


def test_plan_transfer_uses_the_capability_and_explain_names_it():
    cl = _opencl()
    b = polyhal.ProgramBuilder("xfer")
    x = b.input("x", (1024,))
    y = b.op("neg", x, affinity="cpu:0")
    z = b.op("exp", y, affinity="opencl:0")
    w = b.op("neg", z, affinity="cpu:0")
    b.output(w)
    plan = polyhal.compile(b.build(), ["cpu:0", "opencl:0"])
    text = plan.explain()
    assert plan.placement.transfers == 2
    assert "cpu:0 -> opencl:0, 4096 B, by opencl (enqueue_copy)" in text
    assert "opencl:0 -> cpu:0, 4096 B, by opencl (enqueue_copy)" in text
    xs = np.linspace(-2, 2, 1024, dtype=np.float32)
    np.testing.assert_allclose(plan(xs).numpy(), -np.exp(-xs), rtol=1e-5)
    assert cl.is_host is False


def test_transfer_without_capability_is_staged_through_the_host():
    cl, cpu = _opencl(), polyhal.get_device("cpu:0")
    assert route(cl, cl).explain(8) == "opencl:0 -> opencl:0, 8 B, staged through the host"
    assert route(cpu, cpu).explain(8) == "cpu:0 -> cpu:0, 8 B, host copy"


def test_to_device_unknown_name():
    t = polyhal.asarray(np.ones(4, np.float32), device="cpu:0")
    with pytest.raises(DeviceNotFoundError, match="nosuch:3"):
        t.to_device("nosuch:3")


def test_to_device_larger_than_the_destination_memory_names_both_devices():
    cl, cpu = _opencl(), polyhal.get_device("cpu:0")
    previous = set_device_allocator(cl, LimitingAdaptor(cl.allocator, limit=1024))
    try:
        t = polyhal.asarray(np.ones(4096, np.float32), device=cpu)
        with pytest.raises(OutOfMemoryError) as info:
            t.to_device(cl)
        assert "cpu:0" in str(info.value) and "opencl:0" in str(info.value)
    finally:
        set_device_allocator(cl, previous)


def test_queue_timeout_setting(monkeypatch):
    from polyhal.errors import ConfigError

    sem = Semaphore(0, "test/env")
    monkeypatch.setenv("POLYHAL_QUEUE_TIMEOUT", "0.01")
    with pytest.raises(SemaphoreTimeoutError, match="waited 0.01 s for value 1"):
        sem.wait(1)
    monkeypatch.setenv("POLYHAL_QUEUE_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="POLYHAL_QUEUE_TIMEOUT"):
        sem.wait(1)


def _cuda(n: int):
    try:
        return [polyhal.get_device(f"cuda:{i}") for i in range(n)]
    except polyhal.PolyhalError as exc:
        pytest.skip(f"needs {n} CUDA GPU(s): {exc}")


def test_cuda_host_transfers_go_through_pinned_staging():
    (gpu,), cpu = _cuda(1), polyhal.get_device("cpu:0")
    assert route(cpu, gpu).explain(64) == "cpu:0 -> cuda:0, 64 B, by cuda (direct for page-locked host memory, else pinned staging)"
    x = np.arange(1 << 20, dtype=np.float32)
    t = polyhal.asarray(x, device=cpu).to_device(gpu)
    assert t.device is gpu and np.array_equal(t.to_device(cpu).numpy(), x)


def test_cuda_gpu_to_gpu_is_a_peer_copy_or_staged_and_says_which():
    from polyhal_cuda.device import peer_access

    a, b = _cuda(2)
    how = "peer copy" if peer_access(a.ordinal, b.ordinal) else "staged through pinned host memory (no peer access)"
    assert route(a, b).explain(4) == f"cuda:0 -> cuda:1, 4 B, by cuda ({how})"
    x = np.arange(1 << 20, dtype=np.float32)
    t = polyhal.asarray(x, device=a).to_device(b)
    assert t.device is b and np.array_equal(t.numpy(), x)


def test_dlpack_import_onto_another_device_copies_along_the_route_or_refuses():
    from polyhal.errors import DLPackError

    cl = _opencl()
    x = np.arange(256, dtype=np.float32)
    t = polyhal.from_dlpack(x, device=cl)
    assert t.device is cl and np.array_equal(t.numpy(), x)
    with pytest.raises(DLPackError, match="lives on cpu:0; moving it to opencl:0 needs a copy"):
        polyhal.from_dlpack(x, device=cl, copy=False)


# -- fences: device work that reaches a semaphore value ------------------------------------------------

def _host_fence():
    """An EventFence over a threading.Event: completes when the test sets it."""
    from polyhal_gpu.queue import EventFence

    done = threading.Event()
    return done, EventFence(done, "test", lambda e: e.is_set(), lambda e: e.wait(10))


def test_an_attached_fence_reaches_its_value_when_it_completes():
    done, fence = _host_fence()
    sem = Semaphore(0, "test/device")
    sem.attach(2, fence)
    assert sem.value == 0 and sem.fence(1) is fence and sem.fence(2) is fence and sem.fence(3) is None
    sem.wait_enqueued(2, timeout=0)  # issued: returns at once, without waiting for the device
    threading.Timer(0.05, done.set).start()
    sem.wait(2, timeout=10)  # synchronizes the fence
    assert sem.value == 2 and sem.fence(2) is None
    with pytest.raises(ValueError, match="only grow"):
        sem.attach(1, fence)


def test_wait_enqueued_returns_when_a_fence_is_attached_later():
    _, fence = _host_fence()
    sem = Semaphore(0, "test/later")
    threading.Timer(0.05, lambda: sem.attach(1, fence)).start()
    sem.wait_enqueued(1, timeout=10)
    assert sem.fence(1) is fence and sem.value == 0


def test_a_fence_that_fails_fails_the_semaphore():
    from polyhal_gpu.queue import EventFence

    def lost(_):
        raise RuntimeError("device lost")

    sem = Semaphore(0, "test/lost")
    sem.attach(1, EventFence(None, "test", lambda e: False, lost))
    with pytest.raises(SemaphoreFailedError, match="device lost"):
        sem.wait(1, timeout=5)
    assert isinstance(sem.failure, RuntimeError)


def test_opencl_queue_signals_with_events_and_orders_on_the_device():
    dev = _opencl()
    q = dev.queues[0]
    assert q.asynchronous and dev.concurrent_queue is q and q.domain[0] == "opencl"
    from polyhal_opencl.queue import CLQueue

    # A queue of its own: the device's queue may still be issuing an earlier test's work, and
    # work behind a backlog is issued by the queue's thread (deferred), not on this one.
    q = CLQueue(dev, "opencl:0/ordering")
    a, b = q.semaphore(0, "a"), q.semaphore(0, "b")
    x = polyhal.asarray(np.arange(1 << 16, dtype=np.float32), device=dev)
    y = polyhal.empty(x.shape, x.dtype, dev)
    q.copy(x.buffer, 0, y.buffer, 0, x.nbytes, signal=[(a, 1)])
    q.execute([lambda: None], wait=[(a, 1)], signal=[(b, 1)])  # a fence of its own domain: no host wait
    assert q.deferred == 0
    b.wait(1, timeout=30)
    np.testing.assert_array_equal(y.numpy(), x.numpy())


def test_opencl_queue_wait_nothing_satisfies_is_an_error_naming_queue_and_value():
    dev = _opencl()
    from polyhal_opencl.queue import CLQueue

    q = CLQueue(dev, "opencl:0/test", timeout=0.1)
    never, done = q.semaphore(0, "never"), q.semaphore(0, "done")
    ran = []
    q.execute([lambda: ran.append(1)], wait=[(never, 3)], signal=[(done, 1)])  # returns: handed to the issue thread
    with pytest.raises(SemaphoreFailedError) as info:
        done.wait(1, timeout=30)
    cause = info.value.__cause__
    assert isinstance(cause, SemaphoreTimeoutError) and cause.semaphore == "opencl:0/test/never" and cause.value == 3
    assert "opencl:0/test/never" in str(info.value) and "value 3" in str(info.value) and ran == []
    later = q.semaphore(0, "later")  # the queue goes on with later work
    q.execute([lambda: ran.append(2)], signal=[(later, 1)])
    later.wait(1, timeout=30)
    assert ran == [2]


def test_a_semaphore_may_carry_its_own_wait_timeout(monkeypatch):
    monkeypatch.setenv("POLYHAL_QUEUE_TIMEOUT", "30")
    sem = Semaphore(0, "test/own", timeout=0.05)
    start = time.perf_counter()
    with pytest.raises(SemaphoreTimeoutError, match="waited 0.05 s for value 1"):
        sem.wait(1)  # no timeout given: the semaphore's, not POLYHAL_QUEUE_TIMEOUT's
    assert time.perf_counter() - start < 10


def test_host_thread_queue_work_computes_ieee_results_without_warnings():
    """A concurrent plan's CPU part runs on this queue's thread: log(0) is -inf there, as on the
    caller's thread under the plan's np.errstate, with no RuntimeWarning reaching the user."""
    import warnings

    q = HostThreadQueue(polyhal.get_device("cpu:0"), "test/ieee")
    done, out = q.semaphore(0, "done"), []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q.execute([lambda: out.append(np.log(np.zeros(2, np.float32)))], signal=[(done, 1)])
        done.wait(1, timeout=30)
    assert np.isneginf(out[0]).all()
    q.close()
