"""The op set's host side on FakeHipRuntime (a stand-in, not ROCm): kernels are generated,
compiled for real with hiprtc (gfx90a), loaded (the stand-in checks the code object and the
kernel's name in it) and launched (recorded, not executed). What is checked: argument packing,
launch shapes, scratch placement and launch sequences of sort and NMS, error paths -- and the
results of every op that runs through the host fallback, which the stand-in's host memory
makes exact. Kernel *results* need an AMD GPU (``python -m polyhal_hip.selftest``).

CI prepares a representative op of each kernel family; ``POLYHAL_HIP_TEST_OPS=all`` prepares
every op (each kernel instance is a ~0.5 s compile).
"""

from __future__ import annotations


import numpy as np
import pytest

import polyhal
from polyhal.errors import KernelNotFoundError
from polyhal.ops import OPS, core_ops
from polyhal_gpu.elementwise import SNIPPETS
from polyhal_hip import kernels, launch
from polyhal_hip.array import HipArray
from polyhal_hip.device import KernelLaunchError
from polyhal_hip.errors import HipCompileError, HipError
from polyhal_hip.settings import HIPTestSettings

ALL = HIPTestSettings.from_env().ops == "all"
#: One op per kernel family, compiled in CI.
CI_OPS = {"add", "where", "gelu", "mod", "cast", "exp", "reduce_sum", "reduce_max", "matmul", "softmax",
          "layer_norm", "transpose", "slice", "expand", "sort", "topk", "non_max_suppression"}


# -- argument packing (pure) ---------------------------------------------------------------------


def test_pack_aligns_naturally():
    class Arr:
        ptr = 0x1122334455667788

    raw = launch.pack([np.int32(7), Arr(), np.int8(-1), np.float64(1.5), None, launch.Raw(b"\1\2\3", 4), np.uint16(9)])
    assert raw[0:4] == (7).to_bytes(4, "little")
    assert raw[8:16] == (0x1122334455667788).to_bytes(8, "little")  # pointer aligned to 8
    assert raw[16:17] == b"\xff"
    assert raw[24:32] == np.float64(1.5).tobytes()
    assert raw[32:40] == bytes(8)
    assert raw[40:43] == b"\1\2\3" and raw[44:46] == (9).to_bytes(2, "little")
    assert len(raw) == 46


def test_pack_refuses_untyped_python_numbers():
    with pytest.raises(TypeError, match="numpy scalar"):
        launch.pack([3])


def test_dims_struct():
    raw = launch.dims_struct([[4, 3], [3, 1]]).data
    arr = np.frombuffer(raw, np.int64)
    assert arr.size == 16 and list(arr[:3]) == [4, 3, 0] and list(arr[8:10]) == [3, 1]
    with pytest.raises(ValueError, match="at most 8"):
        launch.dims_struct([list(range(9))])


# -- every op on the stand-in -----------------------------------------------------------------------


def _program(op, rng):
    inputs, attrs = OPS[op].sample(rng)
    b = polyhal.ProgramBuilder(op)
    args = [b.input(f"x{i}", x.shape, x.dtype) for i, x in enumerate(inputs)]
    res = b.op(op, *args, **attrs)
    res = res if isinstance(res, tuple) else (res,)
    b.output(*res)
    return b.build(), inputs, attrs, tuple(a.type for a in args), tuple(r.type for r in res)


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_prepares_and_runs_on_the_stand_in(fake, fake_device, needs_compiler, op, rng):
    has_kernel = op in kernels.TABLE.builders
    if OPS[op].fused and not has_kernel:
        # A fused form (fused_conv, ...) is never served by the host fallback: fusion passes
        # leave the unfused ops, which HIP has kernels for, where it has no kernel of its own.
        assert op not in kernels.KERNEL_NAMES
        with pytest.raises(KernelNotFoundError):
            fake_device.prepare(op, *_program(op, rng)[2:])
        return
    if has_kernel and not ALL and op not in CI_OPS:
        pytest.skip("an op with HIP kernels beyond CI's one op per family; POLYHAL_HIP_TEST_OPS=all compiles it")
    program, inputs, attrs, in_types, out_types = _program(op, rng)
    fn = fake_device.prepare(op, attrs, in_types, out_types)
    name = getattr(fn.inner, "kernel_name", "")
    plan = polyhal.compile(program, fake_device.name)
    before = len(fake.launches)
    got = plan(*inputs)
    got = got if isinstance(got, tuple) else (got,)
    if name.startswith("host-fallback"):
        # The stand-in's "device memory" is host memory: the fallback's results are the real ones.
        want = OPS[op].reference(*inputs, **attrs)
        rtol, atol = OPS[op].tolerance
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w, rtol=rtol, atol=atol, err_msg=f"{op}, seed {rng.seed_value}")
    elif all(t.size == 0 for t in out_types):
        assert len(fake.launches) == before  # nothing to compute: no kernel, no launch
    else:
        assert len(fake.launches) > before or name.startswith("hipMemcpy"), f"{op}: no launch recorded ({name})"
        for g, t in zip(got, out_types):
            assert g.shape == t.shape and g.dtype == t.dtype


def test_host_fallback_names_its_ops():
    assert "conv" in kernels.HOST_FALLBACK and "add" not in kernels.HOST_FALLBACK
    assert kernels.KERNEL_NAMES == frozenset(n for n, d in core_ops().items() if not d.fused) | set(kernels.TABLE.builders)


# -- launch arguments ---------------------------------------------------------------------------------


def _compile_one(op, device, shapes, dtype=np.float32, **attrs):
    b = polyhal.ProgramBuilder(op)
    args = [b.input(f"x{i}", s, dtype) for i, s in enumerate(shapes)]
    res = b.op(op, *args, **attrs)
    b.output(*(res if isinstance(res, tuple) else (res,)))
    return polyhal.compile(b.build(), device.name)


def test_broadcast_add_launch_arguments(fake, fake_device, needs_compiler):
    plan = _compile_one("add", fake_device, [(4, 3), (3,)])
    plan(np.ones((4, 3), np.float32), np.ones(3, np.float32))
    last = fake.launches[-1]
    assert last.function == "polyhal_elementwise" and last.block == (256,) and last.grid == (1,)
    raw = last.args
    ptrs = np.frombuffer(raw[:32], np.uint64)
    assert ptrs[0] and ptrs[1] and ptrs[2] == 0 and ptrs[3]  # x0, x1, (no third input), out
    assert np.frombuffer(raw[32:40], np.int64)[0] == 12 and np.frombuffer(raw[40:44], np.int32)[0] == 2
    dims = np.frombuffer(raw[48:48 + 5 * 64], np.int64).reshape(5, 8)
    assert list(dims[0, :2]) == [4, 3]          # output shape
    assert list(dims[1, :2]) == [3, 1]          # x0: dense
    assert list(dims[2, :2]) == [0, 1]          # x1: broadcast over rows
    assert list(dims[4, :3]) == [0, 0, 0]       # offsets


def test_transpose_and_slice_are_strided_copies(fake, fake_device, needs_compiler):
    plan = _compile_one("transpose", fake_device, [(2, 3, 4)], perm=(2, 0, 1))
    plan(np.zeros((2, 3, 4), np.float32))
    dims = np.frombuffer(fake.launches[-1].args[48:48 + 5 * 64], np.int64).reshape(5, 8)
    assert list(dims[0, :3]) == [4, 2, 3] and list(dims[1, :3]) == [1, 12, 4]
    plan = _compile_one("slice", fake_device, [(10,)], starts=(8,), ends=(1,), axes=(0,), steps=(-3,))
    plan(np.zeros(10, np.float32))
    dims = np.frombuffer(fake.launches[-1].args[48:48 + 5 * 64], np.int64).reshape(5, 8)
    assert dims[0, 0] == 3 and dims[1, 0] == -3 and dims[4, 0] == 8


def test_batched_matmul_broadcast_arguments(fake, fake_device, needs_compiler):
    plan = _compile_one("matmul", fake_device, [(2, 1, 4, 5), (3, 5, 6)])
    plan(np.zeros((2, 1, 4, 5), np.float32), np.zeros((3, 5, 6), np.float32))
    last = fake.launches[-1]
    assert last.function == "polyhal_matmul" and last.block == (16, 16) and last.grid == (1, 1, 6)
    m, n, k, batches = np.frombuffer(last.args[24:56], np.int64)
    assert (m, n, k, batches) == (4, 6, 5, 6)
    dims = np.frombuffer(last.args[64:64 + 3 * 64], np.int64).reshape(3, 8)
    assert list(dims[0, :2]) == [2, 3] and list(dims[1, :2]) == [20, 0] and list(dims[2, :2]) == [0, 30]


# -- sort and NMS: scratch and launch sequences --------------------------------------------------------


def _launch_names(fake, start):
    return [launch_.function for launch_ in fake.launches[start:]]


def test_sort_rows_path_scratch_in_shared_memory(fake, fake_device, needs_compiler):
    plan = _compile_one("sort", fake_device, [(4, 100)], axis=-1, descending=False)
    assert "sort_rows.pairs: workgroup" in plan.explain()
    start = len(fake.launches)
    plan(np.zeros((4, 100), np.float32))
    (name,) = _launch_names(fake, start)
    assert "sort_rows" in name
    last = fake.launches[-1]
    assert last.grid == (4,) and last.shared_bytes == 128 * 8  # 128 padded (key, index) pairs in LDS


def test_long_lanes_put_the_pairs_in_global_scratch(fake, fake_device, needs_compiler):
    """Pairs that do not fit in LDS (64 KiB) go to a global arena slice per workgroup (the plan's
    bufferization decides; the kernel gets the address and no dynamic shared memory)."""
    plan = _compile_one("argsort", fake_device, [(2, 20000)], axis=-1, descending=True)
    explain = plan.explain()
    assert "sort_rows.pairs: global" in explain
    start = len(fake.launches)
    plan(np.zeros((2, 20000), np.float32))
    (last,) = fake.launches[start:]
    assert last.grid == (2,) and last.shared_bytes == 0 and last.block == (1024,)
    scratch_ptr = np.frombuffer(last.args[-8:], np.uint64)[0]
    assert scratch_ptr != 0 and any(b.addr <= scratch_ptr < b.addr + b.nbytes for b in fake.live("device"))


def test_topk_unsorted_asks_the_kernel_for_index_order(fake, fake_device, needs_compiler):
    plan = _compile_one("topk", fake_device, [(3000,)], k=10, axis=-1, largest=True, sorted=False)
    start = len(fake.launches)
    plan(np.zeros(3000, np.float32))
    (last,) = fake.launches[start:]
    assert "sort_rows" in last.function
    flags = np.frombuffer(last.args[64:68], np.int32)[0]  # after 3 pointers, 4 int64 and 2 uint32
    assert flags & 16 and flags & 1 and flags & 8  # index order, descending, indices


def test_nms_pipeline(fake, fake_device, needs_compiler):
    b = polyhal.ProgramBuilder("nms")
    boxes, scores = b.input("boxes", (2, 300, 4)), b.input("scores", (2, 3, 300))
    res = b.op("non_max_suppression", boxes, scores, max_output_boxes_per_class=20, iou_threshold=0.5)
    b.output(*(res if isinstance(res, tuple) else (res,)))
    plan = polyhal.compile(b.build(), fake_device.name)
    explain = plan.explain()
    assert "nms_reduce.removed: workgroup" in explain and "nms_pipeline.mask: global" in explain
    start = len(fake.launches)
    plan(np.zeros((2, 300, 4), np.float32), np.zeros((2, 3, 300), np.float32))
    names = _launch_names(fake, start)
    assert "sort_rows" in names[0] and names[1:] == ["nms_boxes", "nms_mask", "nms_reduce", "nms_write"]
    mask = fake.launches[start + 2]
    assert mask.grid == (5, 5, 6) and mask.block == (64,)  # ceil(300 / 64) words, 2 x 3 problems


# -- errors --------------------------------------------------------------------------------------------


def test_a_kernel_that_does_not_compile(fake, fake_device, needs_compiler, monkeypatch):
    monkeypatch.setitem(kernels._BINARY_EXPR, "sub", "(CO)a -* undeclared_name")
    with pytest.raises(HipCompileError, match="undeclared_name") as info:
        _compile_one("sub", fake_device, [(4,), (4,)])
    assert "undeclared identifier" in info.value.log and info.value.arch.startswith("gfx90a")


def test_a_failed_launch_names_kernel_and_shape(fake, fake_device, needs_compiler):
    plan = _compile_one("add", fake_device, [(8,), (8,)])
    fake.inject("hipModuleLaunchKernel", 701)
    with pytest.raises(KernelLaunchError, match=r"launching polyhal_add on hip:0 \(grid \(1,\), block \(256,\).*"
                                                r"hipErrorLaunchOutOfResources") as info:
        plan(np.ones(8, np.float32), np.ones(8, np.float32))
    assert info.value.kernel == "polyhal_add" and info.value.status == 701


def test_module_lookup_errors(fake, fake_device, needs_compiler):
    text = kernels.elementwise_source(1, [np.float32], np.float32, "a")
    with pytest.raises(HipError, match="hipErrorNotFound"):
        fake_device.function(text, "copy.hip", "no_such_kernel")
    with pytest.raises(HipError, match="hipErrorInvalidImage"):
        fake.module_load_data(b"not a code object")


def _generated_sources():
    f16, f32, f64, i32, i64 = (np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64"))
    for op, expr in kernels._BINARY_EXPR.items():
        yield f"ew-{op}", kernels.elementwise_source(2, [f32, f32], f32, expr)
    for op, expr in kernels._FLOAT_UNARY.items():
        yield f"ew-{op}", kernels.elementwise_source(1, [f16], f16, expr)
    for key, (params, _outs, _code) in SNIPPETS.items():
        ins = len(params.split(","))
        dt = f32 if key in ("relu", "sign", "sigmoid", "erf", "gelu_none", "gelu_tanh", "fmod_float") else i32
        yield f"ew-{key}", kernels.elementwise_source(ins, [np.dtype(bool)] + [dt] * (ins - 1) if key == "where"
                                                      else [dt] * ins, dt, body=kernels.snippet_body(key))
    for op in ("reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod"):
        for dt in (f16, f32, f64, i64):
            text = kernels.reduce_source(op, dt)
            if text is not None:
                yield f"{op}-{dt}", text
    for dt in (f16, f32, f64, i32, i64):
        yield f"matmul-{dt}", kernels.matmul_source(dt)


def test_every_generated_hip_source_is_clean():
    """No kernel allocates (the core's kernel lint, as for OpenCL and CUDA sources)."""
    from polyhal.hal.kernel_lint import lint

    names = []
    for name, source in _generated_sources():
        assert lint(source, name, "cuda") == [], name
        names.append(name)
    assert len(names) > 50


def test_a_strict_cast_to_integers_runs_on_the_host_fallback(fake_device, needs_compiler):
    """A strict float -> integer cast (ONNX integer Div) must refuse nan/inf, which needs the
    values: HIP hands it to the host fallback, whose reference checks; a plain cast stays a kernel."""
    from polyhal.ir.types import TensorType

    f64, i64 = (TensorType((4,), np.float64),), (TensorType((4,), np.int64),)
    strict = fake_device.prepare("cast", {"dtype": "int64", "strict": True}, f64, i64)
    assert getattr(strict.inner, "kernel_name", "") == "host-fallback(cast)"
    plain = fake_device.prepare("cast", {"dtype": "int64"}, f64, i64)
    assert getattr(plain.inner, "kernel_name", "") != "host-fallback(cast)"


# -- polyhal-gpu's portable C (grid_sample, roi_align, det, tree_ensemble, tfidf_vectorizer) ----------


def _portable_instance(op):
    """(kernel as planned, inputs, attrs) of the first sample of ``op`` a portable kernel serves."""
    from polyhal.ops import resolve_attrs
    from polyhal_gpu import portable

    for seed in range(20):
        inputs, attrs = OPS[op].sample(np.random.default_rng(seed))
        resolved = resolve_attrs(op, attrs)
        wants = OPS[op].reference(*inputs, **resolved)
        try:
            k = portable.plan(op, resolved, tuple(polyhal.TensorType(x.shape, x.dtype) for x in inputs),
                              tuple(polyhal.TensorType(w.shape, w.dtype) for w in wants), fp64=True)
        except KernelNotFoundError:
            continue
        if k.work_items:
            return k, inputs, attrs
    raise AssertionError(f"no sample of {op} has a portable kernel with work to do")


@pytest.mark.parametrize("op", ["det", "grid_sample", "roi_align", "tfidf_vectorizer", "tree_ensemble"])
def test_portable_kernels_compile_and_launch_on_the_stand_in(fake, fake_device, needs_compiler, op):
    """The planned source, compiled by hiprtc unchanged, loaded by its kernel name, and launched a
    thread per work-item in blocks of 256, each operand followed by its element offset 0."""
    from polyhal_hip import portable

    assert op in portable.OPS and op not in kernels.HOST_FALLBACK
    k, inputs, attrs = _portable_instance(op)
    b = polyhal.ProgramBuilder(op)
    args = [b.input(f"x{i}", x.shape, x.dtype) for i, x in enumerate(inputs)]
    res = b.op(op, *args, **attrs)
    res = res if isinstance(res, tuple) else (res,)
    b.output(*res)
    fn = fake_device.prepare(op, attrs, tuple(a.type for a in args), tuple(r.type for r in res))
    assert fn.inner.kernel_name == f"{k.name} (portable C, hiprtc)"
    plan = polyhal.compile(b.build(), fake_device.name)
    start = len(fake.launches)
    plan(*inputs)
    (last,) = [launch_ for launch_ in fake.launches[start:] if launch_.function == k.name]
    assert last.grid == (-(-k.work_items // 256),) and last.block == (256,) and last.shared_bytes == 0
    words = np.frombuffer(last.args, np.uint64)
    operands = len(inputs) + len(res)
    assert len(words) == 2 * operands and all(words[0::2]) and not any(words[1::2])


def test_portable_instances_it_refuses_and_strided_operands_run_on_the_host(fake, fake_device, needs_compiler, rng):
    """det of 17 x 17 matrices (above what private memory holds) is the host fallback's; a call of
    the portable kernel with a strided operand goes through it too. The stand-in's memory is host
    memory, so both results are exact."""
    big = polyhal.TensorType((2, 17, 17), np.float32)
    fn = fake_device.prepare("det", {}, (big,), (polyhal.TensorType((2,), np.float32),))
    assert fn.inner.kernel_name == "host-fallback(det)"

    x = rng.standard_normal((3, 3, 3)).astype(np.float32)
    cube, three = polyhal.TensorType((3, 3, 3), np.float32), polyhal.TensorType((3,), np.float32)
    fn = fake_device.prepare("det", {}, (cube,), (three,))
    assert "portable" in fn.inner.kernel_name
    xt = polyhal.asarray(x, device=fake_device.name)
    out = polyhal.empty((3,), np.float32, device=fake_device.name)
    transposed = HipArray(xt.native.ptr, (3, 3, 3), np.float32, (9, 1, 3), xt.native.owner)  # each matrix transposed
    before = len(fake.launches)
    fn.inner(transposed, out.native)
    assert len(fake.launches) == before  # no kernel launched
    np.testing.assert_allclose(out.numpy(), np.linalg.det(x.transpose(0, 2, 1)), rtol=1e-5)
