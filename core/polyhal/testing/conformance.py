"""The conformance suite: the contract every polyhal device must meet, run once per device.

Run it on every discovered device (ours and a third party's) with::

    pytest --pyargs polyhal.testing.conformance [--polyhal-backend=NAME] [--polyhal-device=NAME]

Each test takes ``device_name`` (parametrized by :mod:`polyhal.testing.plugin`), so a failure
names the device. Tests that need a capability the device lacks skip and say which: a kernel
test skips for an op the device's kernel table does not serve, a plan test for the kernels it
needs. A device without an allocator fails every test that needs one, saying so.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

import polyhal
from polyhal import dlpack
from polyhal.testing.plugin import session_seed
from polyhal.hal.flags import BufferCompatibility, BufferUsage, MemoryAccess, MemoryType
from polyhal.ops import OPS

#: Requests some devices cannot serve; used to check refusal is clean.
_PROBES = [
    (MemoryType.DEVICE_LOCAL, BufferUsage.DISPATCH_IMAGE_READ | BufferUsage.DISPATCH_IMAGE_WRITE),
    (MemoryType.HOST_LOCAL | MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT),
    (MemoryType.HOST_CACHED | MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT),
    (MemoryType.DEVICE_LOCAL | MemoryType.HOST_VISIBLE, BufferUsage.DEFAULT | BufferUsage.MAPPING),
]


@pytest.fixture
def device(device_name: str) -> polyhal.Device:
    dev = polyhal.get_device(device_name)
    if not isinstance(dev.allocator, polyhal.Allocator):
        pytest.fail(f"{device_name} has no allocator (its allocator is {dev.allocator!r}): set self.allocator "
                    f"in {type(dev).__name__}.__init__ to an instance of a polyhal.Allocator subclass",
                    pytrace=False)
    return dev


def _require_kernels(device: polyhal.Device, *ops: str) -> None:
    """Skip unless ``device`` has a kernel for each of ``ops``."""
    missing = [op for op in ops if op not in device.kernel_names]
    if missing:
        served = sorted(device.kernel_names)
        pytest.skip(f"{device.name} has no kernel for {', '.join(missing)} (this test needs {', '.join(ops)}"
                    + (f"; its kernel table serves {', '.join(served) or 'no op'})" if len(served) < 10 else ")"))


def _fresh_rng() -> tuple[np.random.Generator, int]:
    """A generator seeded from the session's ``POLYHAL_SEED`` (shown in pytest's header; set it
    to reproduce a run) and the running test's id, so each test's samples are the same whatever
    else runs. The seed goes into every failure message."""
    base = session_seed()
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    seed = (base ^ zlib.crc32(test.encode())) & 0xFFFFFFFF
    return np.random.default_rng(seed), seed


def _live(device: polyhal.Device) -> tuple[int, int]:
    s = device.allocator.statistics
    return s.live_bytes, s.live_count


# -- allocator contract ----------------------------------------------------------------------------

def test_allocate_map_free_every_heap(device):
    before = _live(device)
    for heap in device.allocator.heaps:
        compat = device.allocator.query_buffer_compatibility(heap.memory_type, BufferUsage.DEFAULT, 4096)
        assert compat & BufferCompatibility.ALLOCATABLE, f"{device.name}: heap {heap.memory_type.describe()}"
        buf = device.allocator.allocate(4096, heap.memory_type, BufferUsage.DEFAULT)
        assert buf.memory_type & heap.memory_type == heap.memory_type  # more bits allowed, never fewer
        assert buf.nbytes == 4096 and buf.kind == heap.kind
        if heap.memory_type & MemoryType.HOST_VISIBLE:
            data = np.arange(4096, dtype=np.uint32).astype(np.uint8)
            m = buf.map(MemoryAccess.WRITE)
            m[:] = data
            del m
            assert np.array_equal(buf.map(MemoryAccess.READ), data)
        buf.release()
        buf.release()  # idempotent
    assert _live(device) == before


def test_optimal_and_accounting(device):
    before = _live(device)
    a = device.allocator
    bufs = [a.allocate(1000 + i, MemoryType.OPTIMAL, BufferUsage.DEFAULT) for i in range(4)]
    assert a.statistics.live_bytes - before[0] == sum(1000 + i for i in range(4))
    assert a.statistics.peak_bytes >= a.statistics.live_bytes
    del bufs  # garbage collection returns memory too
    assert _live(device) == before


def test_write_read_roundtrip(device):
    rng, seed = _fresh_rng()
    host = rng.standard_normal(1000).astype(np.float32)
    t = polyhal.asarray(host, device=device)
    assert np.array_equal(t.numpy(), host), f"seed {seed}"
    t.release()


def test_zero_d_and_empty_tensors_keep_their_shape(device):
    # 0-d tensors are scalars of programs (ONNX constants, reductions): never made 1-d on the way.
    for host in (np.array(2.5, np.float32), np.zeros((0, 3), np.int32), np.arange(6, dtype=np.int64).reshape(2, 3).T):
        t = polyhal.asarray(host, device=device)
        assert t.shape == host.shape and t.dtype == host.dtype, f"{device.name}: {t.shape} for {host.shape}"
        np.testing.assert_array_equal(t.numpy(), host)
        t.release()


@pytest.mark.parametrize("nbytes", [0, -1, 1 << 62, 1.5, True])
def test_bad_sizes_are_refused(device, nbytes):
    before = _live(device)
    with pytest.raises(polyhal.IncompatibleBufferError):
        device.allocator.allocate(nbytes, MemoryType.OPTIMAL, BufferUsage.DEFAULT)
    assert _live(device) == before


def test_unservable_requests_are_refused(device):
    a = device.allocator
    refused = [(mt, u) for mt, u in _PROBES if not a.query_buffer_compatibility(mt, u)]
    if not refused:
        pytest.skip(f"{device.name} serves every probed memory type and usage")
    before = _live(device)
    for mt, usage in refused:
        with pytest.raises(polyhal.IncompatibleBufferError, match="serves"):
            a.allocate(256, mt, usage)
    assert _live(device) == before


def test_mapping_device_only_memory_is_refused(device):
    heaps = [h for h in device.allocator.heaps if not h.memory_type & MemoryType.HOST_VISIBLE]
    if not heaps:
        pytest.skip(f"every heap of {device.name} is host-visible")
    with device.allocator.allocate(256, heaps[0].memory_type) as buf, pytest.raises(polyhal.MappingError):
        buf.map()


# -- DLPack ----------------------------------------------------------------------------------------

def _require_addressable(device: polyhal.Device) -> None:
    if "remote" in device.spec.capabilities:
        pytest.skip(f"{device.name} is memory of another process (capability 'remote'): DLPack cannot address "
                    "it from here")


def test_dlpack_roundtrip_every_heap(device):
    _require_addressable(device)
    rng, seed = _fresh_rng()
    for heap in device.allocator.heaps:
        host = rng.standard_normal((3, 5)).astype(np.float32)
        t = polyhal.asarray(host, device=device, memory_type=heap.memory_type)
        dev_type, dev_id = t.__dlpack_device__()
        back = polyhal.from_dlpack(t)
        assert back.device is device
        assert device.buffer_address(back.buffer) == device.buffer_address(t.buffer)  # zero copy
        assert np.array_equal(back.numpy(), host), f"seed {seed}"
        if dev_type == 1:
            view = np.from_dlpack(t)
            assert view.ctypes.data == device.buffer_address(t.buffer)
            assert np.array_equal(view, host)
        else:
            # device memory reaches a CPU consumer as a copy (dl_device=CPU, copy allowed)
            assert np.array_equal(np.from_dlpack(t, device="cpu"), host), f"seed {seed}"
        back.release()
        t.release()


def test_dlpack_capsule_consumed_twice(device):
    _require_addressable(device)
    t = polyhal.asarray(np.ones(4, np.float32), device=device)
    capsule = t.__dlpack__(max_version=(1, 0))
    first = polyhal.from_dlpack(capsule)
    with pytest.raises(polyhal.DLPackError, match="consumed"):
        dlpack.from_capsule(capsule)
    first.release()
    t.release()


# -- kernels ---------------------------------------------------------------------------------------

def _op_names():
    """Every op the suite checks: the core op set and the ops of the discovered backends (a
    backend defines its own when its plugin is imported, which discovery does)."""
    polyhal.devices()
    return sorted(OPS)


def test_declared_kernel_names_are_the_kernels_it_serves(device):
    # Placement and fusion read the spec's set without creating the device: it must not differ.
    declared = device.spec.kernel_names
    if declared is None:
        pytest.skip(f"{device.name}'s DeviceSpec declares no kernel_names (compiles create it to ask)")
    assert declared == device.kernel_names, (
        f"{device.name}: DeviceSpec.kernel_names and the device's kernel_names differ: only declared "
        f"{sorted(declared - device.kernel_names)}, only served {sorted(device.kernel_names - declared)}")


@pytest.mark.parametrize("op", _op_names())
def test_kernel_matches_reference(device, op):
    _require_kernels(device, op)
    opdef = OPS[op]
    rng, seed = _fresh_rng()
    inputs, attrs = opdef.sample(rng)
    b = polyhal.ProgramBuilder(op)
    args = [b.input(f"x{i}", x.shape, x.dtype) for i, x in enumerate(inputs)]
    res = b.op(op, *args, **attrs)
    b.output(*(res if isinstance(res, tuple) else (res,)))
    plan = polyhal.compile(b.build(), device.name)
    got = plan(*inputs)
    got = got if isinstance(got, tuple) else (got,)
    want = opdef.reference(*inputs, **attrs)
    rtol, atol = opdef.tolerance
    for g, w in zip(got, want):
        g = g.numpy()
        assert g.shape == w.shape and g.dtype == w.dtype, f"{op} on {device.name}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{op} on {device.name}, seed {seed}")


#: Values whose results an op's semantics define: zeros of both signs, nan, +-inf and float32
#: denormals (which a device may flush to zero: within every op's tolerance).
SPECIAL_VALUES = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40, -1e-40], np.float32)

#: Ops whose documentation says what the special values give (IEEE arithmetic, nan propagation
#: of maximum/minimum and relu, nan comparing unequal, ...): the suite feeds them those values,
#: and an empty tensor, besides the random samples. Integer inputs are left alone.
SPECIAL_OPS = ("abs", "add", "ceil", "div", "equal", "exp", "floor", "greater", "greater_equal", "isinf",
               "isnan", "less", "less_equal", "log", "maximum", "minimum", "mul", "neg", "not_equal", "relu",
               "sigmoid", "sign", "sqrt", "sub", "tanh", "where")


def _with_specials(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    """``x`` with about a third of its elements (at least one) replaced by special values."""
    if x.dtype.kind != "f" or not x.size:
        return x
    y = x.copy().reshape(-1)
    hit = rng.random(y.size) < 1 / 3
    hit[rng.integers(y.size)] = True
    y[hit] = rng.choice(SPECIAL_VALUES, size=int(hit.sum())).astype(x.dtype)
    return y.reshape(x.shape)


def _flushed(x: np.ndarray) -> np.ndarray:
    """``x`` with its float32 denormals flushed to (signed) zero, as an ``ftz`` device reads them."""
    if x.dtype != np.float32:
        return x
    tiny = np.finfo(np.float32).tiny
    return np.where(np.abs(x) < tiny, np.copysign(np.float32(0), x), x).astype(np.float32)


def _check_one_op(device, op: str, inputs: list, attrs: dict, what: str) -> None:
    opdef = OPS[op]
    b = polyhal.ProgramBuilder(op)
    args = [b.input(f"x{i}", x.shape, x.dtype) for i, x in enumerate(inputs)]
    res = b.op(op, *args, **attrs)
    b.output(*(res if isinstance(res, tuple) else (res,)))
    got = polyhal.compile(b.build(), device.name)(*inputs)
    got = got if isinstance(got, tuple) else (got,)
    with np.errstate(all="ignore"):  # the specials raise numpy's warnings in the reference
        want = opdef.reference(*(_flushed(x) if "ftz" in device.spec.capabilities else x for x in inputs), **attrs)
    rtol, atol = opdef.tolerance
    for g, w in zip(got, want):
        g = g.numpy()
        assert g.shape == w.shape and g.dtype == w.dtype, f"{op} on {device.name} ({what}): {g.shape} {g.dtype}"
        # nan where the reference has nan, equal infinities, the rest within tolerance
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, equal_nan=True,
                                   err_msg=f"{op} on {device.name} ({what}); inputs {inputs}")


@pytest.mark.parametrize("op", SPECIAL_OPS)
def test_kernel_special_values(device, op):
    if op not in device.kernel_names:
        pytest.skip(f"{device.name} has no kernel for {op}")
    rng, seed = _fresh_rng()
    for _ in range(3):
        inputs, attrs = OPS[op].sample(rng)
        inputs = [_with_specials(rng, x) for x in inputs]
        _check_one_op(device, op, inputs, attrs, f"zeros, nan, inf, denormals; seed {seed}")


@pytest.mark.parametrize("op", SPECIAL_OPS)
def test_kernel_empty_tensors(device, op):
    if op not in device.kernel_names:
        pytest.skip(f"{device.name} has no kernel for {op}")
    rng, seed = _fresh_rng()
    inputs, attrs = OPS[op].sample(rng)
    inputs = [np.zeros((0, 3), x.dtype) for x in inputs]  # elementwise: every operand the same shape
    _check_one_op(device, op, inputs, attrs, f"empty tensors; seed {seed}")


def test_plan_runs_repeatedly_and_balances(device):
    _require_kernels(device, "add", "relu")
    rng, seed = _fresh_rng()
    before = _live(device)
    b = polyhal.ProgramBuilder("chain")
    x, y = b.input("x", (8, 16)), b.input("y", (16,))
    b.output(b.add(b.relu(b.add(x, y)), x))  # an intermediate, and an input read twice
    plan = polyhal.compile(b.build(), device.name)
    for _ in range(3):
        xs, ys = rng.standard_normal((8, 16), np.float32), rng.standard_normal(16, np.float32)
        np.testing.assert_allclose(plan(x=xs, y=ys).numpy(), np.maximum(xs + ys, 0) + xs, rtol=1e-6,
                                   err_msg=f"seed {seed}")
    del plan
    assert _live(device) == before


def test_plan_input_errors(device):
    _require_kernels(device, "add")
    b = polyhal.ProgramBuilder("add")
    x, y = b.input("x", (4,)), b.input("y", (4,))
    b.output(b.add(x, y))
    plan = polyhal.compile(b.build(), device.name)
    with pytest.raises(polyhal.DTypeError, match="astype"):
        plan(np.ones(4, np.float64), np.ones(4, np.float32))
    with pytest.raises(polyhal.ShapeError):
        plan(np.ones(5, np.float32), np.ones(4, np.float32))
    with pytest.raises(polyhal.ProgramError, match="missing"):
        plan(np.ones(4, np.float32))


# -- storage-only element types --------------------------------------------------------------------

def _storage_sources(dtype: np.dtype, rng: np.random.Generator) -> dict[np.dtype, np.ndarray]:
    """Values to convert to storage type ``dtype``, per source type: every float32 that ``dtype``
    holds, the midpoints between neighbours and the floats next to them (where rounding
    decides), zeros, infinities, nans of both signs, float32 subnormals, values beyond the range,
    random float32 bit patterns; every float16; float64, integers and bools."""
    grid = np.unique(np.arange(1 << (8 * dtype.itemsize), dtype=f"u{dtype.itemsize}").view(dtype)
                     .astype(np.float32))
    grid = grid[np.isfinite(grid)].astype(np.float64)
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    up, down = np.float32(np.inf), np.float32(-np.inf)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 1e-40, 1e-38, 3e38, -3e38,
                         2.0 ** 31, -(2.0 ** 31), 2.0 ** 31 + 2.0 ** 8, 7.99, -8.5, 1e10], np.float32)
    f32 = np.concatenate([grid.astype(np.float32), mids, np.nextafter(mids, up), np.nextafter(mids, down),
                          grid.astype(np.float32) * 4, specials,
                          rng.integers(0, 1 << 32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    ints = np.concatenate([np.arange(-300, 300), rng.integers(-(1 << 40), 1 << 40, 1000)])
    return {np.dtype(np.float32): f32, np.dtype(np.float16): np.arange(1 << 16, dtype=np.uint16).view(np.float16),
            np.dtype(np.float64): np.concatenate([f32.astype(np.float64), rng.standard_normal(1000) * 300]),
            np.dtype(np.int32): ints.astype(np.int32), np.dtype(np.int64): ints,
            np.dtype(np.uint8): np.arange(256, dtype=np.uint8), np.dtype(np.bool_): np.array([True, False])}


def _cast_on(device, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    b = polyhal.ProgramBuilder("cast")
    b.output(b.op("cast", b.input("x", x.shape, x.dtype), dtype=str(dtype)))
    return polyhal.compile(b.build(), device.name)(x).numpy()


def _same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal element for element: storage types bit for bit, floats with nan equal to nan."""
    assert got.dtype == want.dtype, what
    if want.dtype in (np.float16, np.float32, np.float64):  # (ml_dtypes' float8_e5m2 says kind "f" too)
        np.testing.assert_array_equal(got, want, err_msg=what)  # nan == nan, -0 == 0 (bits next)
        np.testing.assert_array_equal(np.signbit(got[~np.isnan(want)]), np.signbit(want[~np.isnan(want)]), what)
        return
    g, w = got.view(f"u{want.dtype.itemsize}"), want.view(f"u{want.dtype.itemsize}")
    differ = g != w
    if differ.any() and want.dtype in polyhal.ir.types.STORAGE_DTYPES and want.dtype.kind != "i":
        # A nan's sign carries nothing (a GPU's float16 reads may drop it): nan for nan is
        # equal, and so is float4's zero for a nan (it has no nan; ml_dtypes gives the zero the
        # sign opposite to the nan's).
        gf, wf = got.astype(np.float32), want.astype(np.float32)
        differ &= ~((np.isnan(gf) & np.isnan(wf)) | ((gf == 0) & (wf == 0) & (want.dtype.name == "float4_e2m1fn")))
    bad = np.nonzero(differ)[0]
    assert not bad.size, f"{what}: {bad.size} elements differ, e.g. at {bad[:5].tolist()}: {g[bad[:5]]} vs {w[bad[:5]]}"


def _require_storage_casts(device: polyhal.Device) -> None:
    """Skip unless ``device``'s cast converts the storage-only element types."""
    table = device.kernels
    if table is None or "cast" not in device.kernel_names or not table.holds_storage("cast"):
        pytest.skip(f"{device.name} does not convert the storage-only element types")


def _storage_dtype(name: str) -> np.dtype:
    return np.dtype(next(d for d in polyhal.ir.types.STORAGE_DTYPES if d.name == name))


@pytest.mark.parametrize("name", sorted(d.name for d in polyhal.ir.types.STORAGE_DTYPES))
def test_storage_type_casts(device, name):
    """cast to and from a storage-only type is bit-exact with ml_dtypes' astype (the op's
    reference), on every device whose kernels convert them: every bit pattern decoded, and the
    values where rounding, overflow and the special values decide encoded."""
    _require_storage_casts(device)
    dtype = _storage_dtype(name)
    rng, seed = _fresh_rng()
    fp64 = "fp64" in device.spec.capabilities
    every = np.arange(1 << (8 * dtype.itemsize), dtype=f"u{dtype.itemsize}").view(dtype)
    decoded = every.astype(np.float32)
    for target in (np.float32, np.float16, np.float64, np.bool_):
        if target == np.float64 and not fp64:
            continue
        got, want = _cast_on(device, every, np.dtype(target)), every.astype(target)
        if "ftz" in device.spec.capabilities:  # a float32 subnormal may read as zero there, or not
            normal = ~(np.abs(decoded) < np.finfo(np.float32).tiny) | (decoded == 0)
            got, want = got[normal], want[normal]
        _same_bits(got, want, f"{name} -> {np.dtype(target)}")
    for target in (np.int8, np.int32, np.uint8, np.int64):  # out of range and nan: unspecified
        info = np.iinfo(target)
        wide = decoded.astype(np.float64)  # compared with max + 1 (int32's max is 2**31 in float32, int64's 2**63 in float64)
        fine = np.isfinite(wide) & (wide >= info.min) & (wide < info.max + 1.0)
        _same_bits(_cast_on(device, every, np.dtype(target))[fine], every.astype(target)[fine],
                   f"{name} -> {np.dtype(target).name}")
    for other in ("float8_e4m3fn", "int4", "bfloat16"):  # storage to storage, through float32
        to = np.dtype(next(d for d in polyhal.ir.types.STORAGE_DTYPES if d.name == other))
        fine = ~np.isinf(decoded) if other == "int4" else slice(None)  # inf to an integer: unspecified
        with np.errstate(all="ignore"):
            (want,) = OPS["cast"].reference(every, dtype=to.name)  # ml_dtypes, some pairs through float32
        _same_bits(_cast_on(device, every, to)[fine], want[fine], f"{name} -> {other}")
    for src, values in _storage_sources(dtype, rng).items():
        if src == np.float64 and not fp64:
            continue
        if src in (np.float32, np.float64) and "ftz" in device.spec.capabilities:
            # float32 subnormals (read, or made from float64) are zero there, as the device declares
            values = values[~(np.abs(values) < np.finfo(np.float32).tiny) | (values == 0)]
        with np.errstate(all="ignore"):
            want = values.astype(dtype)
        _same_bits(_cast_on(device, values, dtype), want, f"{src} -> {name}, seed {seed}")


def test_storage_casts_at_the_edges(device):
    """The rules test_storage_type_casts finds only by chance in its random values, spelled out
    (ml_dtypes 0.7's): a real to a sub-byte integer truncates toward zero and is 0 outside the
    type's range, nan and inf too; float64 and integers wider than float32's 24 bits round once,
    straight to the type (through float32 to nearest, the values just off a tie would move); a
    float32 subnormal to float8e8m0 is 2**-126 from 1.5 * 2**-127 on."""
    _require_storage_casts(device)
    fp64, ftz = "fp64" in device.spec.capabilities, "ftz" in device.spec.capabilities
    reals = [7.9, 8.0, -8.0, -8.9, -9.0, 15.5, 16.0, -0.5, 1.9, -2.5, np.nan, np.inf, -np.inf, 3e9]
    truncated = {"int4": [7, 0, -8, -8, 0, 0, 0, 0, 1, -2, 0, 0, 0, 0],
                 "uint4": [7, 8, 0, 0, 0, 15, 0, 0, 1, 0, 0, 0, 0, 0],
                 "int2": [0, 0, 0, 0, 0, 0, 0, 0, 1, -2, 0, 0, 0, 0],
                 "uint2": [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0]}
    cases = [(np.array(reals, real), name, np.array(want, np.int8).astype(_storage_dtype(name)))
             for name, want in truncated.items() for real in ([np.float32, np.float64] if fp64 else [np.float32])]
    # Just off a tie: bfloat16's between 1 and 1 + 2**-7, float8e4m3fn's between 1 and 1.125,
    # and (for an integer) bfloat16's between 2**30 and 2**30 + 2**23 and float8e8m0's between
    # 2**25 and 2**26 (1.5 * 2**25); float64 2**-200 is float8e8m0's smallest, 2**-127, not nan.
    wide = [([1 + 2.0 ** -8 + 2.0 ** -40, 1 + 2.0 ** -8 - 2.0 ** -40], "bfloat16", [0x3F81, 0x3F80]),
            ([1.0625 + 2.0 ** -40, 1.0625 - 2.0 ** -40], "float8_e4m3fn", [0x39, 0x38])]
    if not ftz:
        wide.append(([2.0 ** -200, 1.0], "float8_e8m0fnu", [0, 127]))
    cases += [(np.array(x), name, np.array(bits, f"u{_storage_dtype(name).itemsize}").view(_storage_dtype(name)))
              for x, name, bits in (wide if fp64 else [])]
    ints = [2 ** 30 + 2 ** 22 + 1, 2 ** 30 + 2 ** 22 - 1, 3 * 2 ** 24 - 1]
    for integer in (np.int32, np.uint32, np.int64, np.uint64):
        cases.append((np.array(ints, integer), "bfloat16", np.array([0x4E81, 0x4E80, 0x4C40], np.uint16)
                      .view(_storage_dtype("bfloat16"))))
        cases.append((np.array(ints, integer), "float8_e8m0fnu", np.array([157, 157, 152], np.uint8)
                      .view(_storage_dtype("float8_e8m0fnu"))))
    if not ftz:  # float32 subnormals: 2**-127, just under 1.5 * 2**-127, 1.5 * 2**-127, just under 2**-126
        cases.append((np.array([0x400000, 0x5FFFFF, 0x600000, 0x7FFFFF], np.uint32).view(np.float32),
                      "float8_e8m0fnu", np.array([0, 0, 1, 1], np.uint8).view(_storage_dtype("float8_e8m0fnu"))))
    for x, name, want in cases:
        _same_bits(_cast_on(device, x, _storage_dtype(name)), want, f"{x.dtype} {x.tolist()} -> {name}")


def test_queues_order_copies_and_signal(device, monkeypatch):
    """Every queue of the device, and the queue a concurrent plan uses, copies in order and
    signals its timeline semaphore; a wait that nothing satisfies ends as an error."""
    from polyhal.errors import SemaphoreFailedError, SemaphoreTimeoutError
    from polyhal.hal.queue import Semaphore

    rng, seed = _fresh_rng()
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    src = polyhal.asarray(data, device=device)
    queues = list(device.queues)
    if device.concurrent_queue not in queues:
        queues.append(device.concurrent_queue)
    for q in queues:
        dst = polyhal.empty(data.shape, data.dtype, device)
        copied, done = q.semaphore(0, "copied"), q.semaphore(0, "done")
        q.copy(src.buffer, 0, dst.buffer, 0, data.nbytes, signal=[(copied, 1)])
        q.execute([lambda: None], wait=[(copied, 1)], signal=[(done, 1)])
        done.wait(1, timeout=60)
        assert np.array_equal(dst.numpy(), data), f"{q.name}: queue copy differs (seed {seed})"
        monkeypatch.setenv("POLYHAL_QUEUE_TIMEOUT", "0.2")  # (the queue's own waits, not the test's)
        never, failed = Semaphore(0, f"{q.name}/never"), q.semaphore(0, "failed")
        try:
            q.execute([lambda: None], wait=[(never, 1)], signal=[(failed, 1)])
        except SemaphoreTimeoutError:
            pass  # a synchronous queue waits (and times out) on the caller's thread
        with pytest.raises((SemaphoreFailedError, SemaphoreTimeoutError)):
            failed.wait(1, timeout=120)
        monkeypatch.delenv("POLYHAL_QUEUE_TIMEOUT")
        dst.release()
