"""Fuzzing the DLPack importer with mutated capsules: every one is imported correctly or refused with a
polyhal error, never another exception, a crash or a read outside the producer's memory.

Real capsules (numpy's, versioned and legacy, of arrays and strided views of several dtypes) get 1 to
3 of their fields changed (ndim, an extent, a stride, byte_offset, the data pointer, the element type,
the device, the version, the flags) and are imported through a numpy producer, whose memory polyhal
can bound. The oracle is numpy's own ``ndarray(shape, dtype, buffer, offset, strides)``, which refuses
a layout that leaves its buffer: what it refuses polyhal must refuse, and what polyhal imports must
hold the bytes numpy reads. (polyhal may refuse more, e.g. negative strides, which its tensors do not
describe.) It runs in a child process, so a crash fails the test instead of the session.
``POLYHAL_FUZZ=N`` runs N mutants (default 300); the seed comes from ``POLYHAL_SEED``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from polyhal.testing.settings import TestSettings

MEMORY_LIMIT = 3 << 30

CHILD = r"""
import ctypes, json, random, resource, sys, traceback
import numpy as np
import polyhal
from polyhal import dlpack
from polyhal.errors import DLPackError, PolyhalError
try:
    from numpy.lib.array_utils import byte_bounds  # numpy >= 2
except ImportError:
    from numpy import byte_bounds

seed, count = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(seed)
get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
DTYPES = [np.float32, np.float64, np.int8, np.uint16, np.int64, np.bool_, np.complex64, np.float16]
keep = []  # shape/strides arrays the mutated capsules point at: they must outlive every import


class Producer(np.ndarray):
    # A numpy array (so its memory is known) whose __dlpack__ hands over the mutated capsule.
    def __dlpack__(self, **_kw):
        return self.capsule


def real_array():
    dtype = rng.choice(DTYPES)
    base = np.frombuffer(bytes(rng.randrange(256) for _ in range(8 * 64)), np.uint8)[:rng.choice([64, 512])]
    base = base[: base.size // np.dtype(dtype).itemsize * np.dtype(dtype).itemsize].view(dtype).copy()
    arr = base.reshape(rng.choice([(base.size,), (4, -1), (2, 4, -1)]))
    views = [lambda a: a, lambda a: a[..., 1::3], lambda a: a[1:], lambda a: a.T, lambda a: a[..., :0],
             lambda a: a.reshape(-1)[5]]
    return np.asarray(rng.choice(views)(arr))


def mutate(t, managed, versioned):
    ndim = t.ndim
    for _ in range(rng.randint(1, 3)):
        what = rng.randrange(9)
        if what == 0:
            t.ndim = rng.choice([0, 1, ndim + 1, max(ndim - 1, 0), 64, 65, -1, (1 << 31) - 1])
        elif what == 1 and t.ndim > 0:
            t.shape[rng.randrange(min(t.ndim, 64))] = rng.choice([-1, 0, 1, 2, 7, 1 << 31, 1 << 62])
        elif what == 2 and t.ndim > 0 and t.strides:
            t.strides[rng.randrange(min(t.ndim, 64))] = rng.choice([0, 1, -1, 3, 64, -64, 1 << 40, 1 << 62])
        elif what == 3:
            t.strides = None if rng.random() < 0.5 else t.strides
        elif what == 4:
            t.byte_offset = rng.choice([1, 8, 64, 4096, 1 << 63, (1 << 64) - 1])
        elif what == 5:
            t.data = rng.choice([0, 16, (t.data or 0) + 8, max((t.data or 0) - 8, 0), (1 << 64) - 16]) or None
        elif what == 6:
            t.dtype.code, t.dtype.bits = rng.choice([(0, 32), (2, 64), (1, 8), (2, 8), (6, 8), (4, 16), (9, 7)])
            t.dtype.lanes = rng.choice([1, 1, 1, 2])
        elif what == 7:
            t.device.device_type = rng.choice([1, 2, 3, 4, 99])
        elif versioned:
            managed.version.major = rng.choice([0, 1, 2])
            managed.flags = rng.choice([0, 1, 2, 3, 1 << 60])


def expected(t, managed, versioned, lo, hi):
    # numpy's reading of the mutated description, or None where numpy (or DLPack) says it is wrong.
    if versioned and managed.version.major > 1 or t.device.device_type != 1:
        return None
    if not 0 <= t.ndim <= 64:
        return None
    try:
        dtype = dlpack.numpy_dtype(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    except DLPackError:
        return None
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = [t.strides[i] for i in range(t.ndim)] if t.strides else list(dlpack.row_major_strides(shape))
    offset = (t.data or 0) + t.byte_offset - lo
    memory = (ctypes.c_char * (hi - lo)).from_address(lo)
    try:
        if 0 in shape and all(n >= 0 for n in shape):
            return np.empty(shape, dtype)  # no byte is read: only the extents must make sense
        if not t.data or not 0 <= offset <= hi - lo:
            return None
        return np.ndarray(shape, dtype, memory, offset, [s * dtype.itemsize for s in strides])
    except (ValueError, TypeError, OverflowError):  # numpy refuses the layout
        return None


outcomes = {"imported": 0, "refused": 0, "refused_valid": 0}
for i in range(count):
    arr = real_array()
    versioned = rng.random() < 0.7
    capsule = arr.__dlpack__(max_version=(1, 0)) if versioned else arr.__dlpack__()
    kind = dlpack.DLManagedTensorVersioned if versioned else dlpack.DLManagedTensor
    managed = kind.from_address(get_pointer(capsule, b"dltensor_versioned" if versioned else b"dltensor"))
    t = managed.dl_tensor
    shape, strides = (ctypes.c_int64 * 64)(*t.shape[:t.ndim]), (ctypes.c_int64 * 64)(*t.strides[:t.ndim])
    keep.append((shape, strides))
    t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    mutate(t, managed, versioned)
    lo, hi = byte_bounds(arr)
    want = expected(t, managed, versioned, lo, hi)
    producer = arr.view(Producer)
    producer.capsule = capsule
    del capsule
    try:
        tensor = polyhal.from_dlpack(producer)
        # A broadcast (stride 0) view can be huge and still valid: then compare the layout only.
        got = tensor.numpy() if tensor.type.nbytes <= (1 << 24) else None
    except PolyhalError:
        outcomes["refused"] += 1
        outcomes["refused_valid"] += want is not None
        continue
    except BaseException as exc:
        traceback.print_exc()
        print(json.dumps({"mutant": i, "error": f"{type(exc).__name__}: {exc}"[:500]}))
        sys.exit(3)
    if (want is None or tensor.shape != want.shape or tensor.dtype != want.dtype
            or (got is not None and got.tobytes() != want.tobytes())):
        print(json.dumps({"mutant": i, "error": f"imported {tensor.dtype}{list(tensor.shape)} where numpy reads "
                          f"{'nothing (it refuses)' if want is None else f'{want.dtype}{list(want.shape)}'}"
                          f" or other bytes"}))
        sys.exit(4)
    outcomes["imported"] += 1
outcomes["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(json.dumps(outcomes))
"""


def test_mutated_capsules_import_correctly_or_give_polyhal_errors(polyhal_seed):
    seed = polyhal_seed
    count = TestSettings.from_env().fuzz or 300

    def limit_memory():
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_LIMIT, MEMORY_LIMIT))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), POLYHAL_BACKENDS="cpu")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(seed), str(count)], capture_output=True, text=True,
                          env=env, timeout=60 + count // 10, preexec_fn=limit_memory)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, (f"POLYHAL_SEED={seed} POLYHAL_FUZZ={count}: child exited {proc.returncode} "
                                  f"(negative: killed by that signal): {last} {proc.stderr[-2000:]}")
    outcomes = json.loads(last)
    assert outcomes["imported"] + outcomes["refused"] == count
    # The mutations must reach both sides, or the fuzzer tests nothing.
    assert outcomes["imported"] and outcomes["refused"] > outcomes["refused_valid"]
