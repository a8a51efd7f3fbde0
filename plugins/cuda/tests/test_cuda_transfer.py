"""Host <-> device copies (polyhal_cuda.transfer): staged pageable copies and the direct path
for page-locked host memory, including allocations registered on their second copy."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from polyhal_cuda.transfer import REGISTER_MIN, SMALL, host_registrations


def test_a_reused_large_host_array_is_registered_on_its_second_copy(cuda, cp, rng):
    n = REGISTER_MIN
    src = rng.integers(0, 256, n, dtype=np.uint8)
    dev = cp.empty(n, cp.uint8)
    host = np.empty(n, np.uint8)
    before = host_registrations.registered
    cuda.stager.h2d(dev.data.ptr, src)  # first sighting of src: staged
    assert not host_registrations.page_locked(src.ctypes.data, n)
    cuda.stager.d2h(host, dev.data.ptr)
    assert np.array_equal(host, src)
    cuda.stager.h2d(dev.data.ptr, src)  # second: registered, then one DMA
    assert host_registrations.page_locked(src.ctypes.data, n)
    assert host_registrations.registered == before + 1
    host[:] = 0
    cuda.stager.d2h(host, dev.data.ptr)  # host's second copy: registered too
    assert host_registrations.registered == before + 2
    assert np.array_equal(host, src)
    # A view into a registered allocation goes direct as well, and the data lands where it should.
    part = host[n // 4: n // 2]
    part[:] = 7
    cuda.stager.d2h(part, dev.data.ptr)
    assert np.array_equal(part, src[: n // 4])
    del src, host, part
    gc.collect()  # the registrations go with their arrays (unregistered before numpy frees them)


def test_small_and_one_off_copies_are_not_registered(cuda, cp, rng):
    before = host_registrations.registered
    small = rng.standard_normal(SMALL // 8).astype(np.float32)
    dev = cp.empty(small.size, cp.float32)
    for _ in range(3):
        cuda.stager.h2d(dev.data.ptr, small)
    once = rng.integers(0, 256, REGISTER_MIN, dtype=np.uint8)
    big = cp.empty(once.size, cp.uint8)
    cuda.stager.h2d(big.data.ptr, once)
    assert host_registrations.registered == before
    assert np.array_equal(cp.asnumpy(big[:4096]), once[:4096])


def test_a_users_pinned_array_goes_direct_without_registering(cuda, cp, rng):
    import cupyx

    n = REGISTER_MIN
    pinned = cupyx.empty_pinned(n, np.uint8)
    pinned[:] = rng.integers(0, 256, n, dtype=np.uint8)
    assert host_registrations.page_locked(pinned.ctypes.data, n)
    before = host_registrations.registered
    dev = cp.empty(n, cp.uint8)
    cuda.stager.h2d(dev.data.ptr, pinned)
    out = np.empty(n, np.uint8)
    cuda.stager.d2h(out, dev.data.ptr)
    assert np.array_equal(out, pinned)
    assert host_registrations.registered == before  # (out was seen once: staged)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_memory_numpy_does_not_own_is_staged(cuda, cp, rng, direction):
    raw = bytearray(REGISTER_MIN)
    view = np.frombuffer(raw, np.uint8)  # base is a bytearray: never registered
    dev = cp.asarray(rng.integers(0, 256, REGISTER_MIN, dtype=np.uint8))
    before = host_registrations.registered
    for _ in range(2):
        if direction == "h2d":
            cuda.stager.h2d(dev.data.ptr, view)
        else:
            cuda.stager.d2h(view, dev.data.ptr)
    assert host_registrations.registered == before
