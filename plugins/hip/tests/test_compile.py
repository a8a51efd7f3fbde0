"""Kernels compiled for real with hiprtc (Debian's ROCm 5.2 in CI) for several AMD GPU
architectures, to AMD GPU code objects -- each architecture in its own process, because the
compiler of some ROCm versions aborts the process for an architecture it does not know.

Every kernel source is compiled: polyhal-gpu's ``rowwise.cu``, ``sort.cu`` (the whole file, with
the bitonic instance HIP launches),
``nms.cu`` behind ``compat.h``, its portable C (``c/*.c``: one instance of each op, as planned),
its storage conversions (``c/storage_types.h``: every cast, as CUDA compiles them),
and polyhal-hip's ``elementwise.hip`` (an instance built from
an expression and one from a polyhal-gpu snippet), ``reduce.hip`` and ``matmul.hip``. The
architectures are ``POLYHAL_HIP_TEST_ARCHS`` (default ``gfx90a,gfx908,gfx1030``: CDNA2,
CDNA1 wave64 and RDNA2 wave32). With ``POLYHAL_HIP_TEST_COMPILE=all`` every bitonic instance
(every key width and kind) is compiled too; CI compiles the representative set.
"""

from __future__ import annotations


import numpy as np
import pytest

from polyhal.errors import ConfigError, KernelNotFoundError
from polyhal_gpu import rowwise
from polyhal_hip import compiler, kernels
from polyhal_hip.errors import HipCompileError
from polyhal_hip.runtime import CompileResult, Runtime
from polyhal_hip.settings import HIPTestSettings

ARCHS = list(HIPTestSettings.from_env().archs)
ALL = HIPTestSettings.from_env().compile == "all"
F16, F32, F64, I64 = (np.dtype(t) for t in ("float16", "float32", "float64", "int64"))


def representative_sources() -> list[tuple[str, str, tuple[str, ...]]]:
    """(label, source text, name expressions) of every kernel source, one instance each."""
    out = [
        ("rowwise.cu (polyhal-gpu)", compiler.source("rowwise.cu"), rowwise.EXPRESSIONS),
        ("sort.cu (polyhal-gpu)", compiler.source("sort.cu"), ("sort_rows<unsigned int, 2>",)),
        ("nms.cu (polyhal-gpu)", compiler.source("nms.cu"), ()),
        ("elementwise.hip add", kernels.elementwise_source(2, [F32, F32], F32, "(CO)a + (CO)b"), ()),
        ("elementwise.hip gelu_tanh float16 (polyhal-gpu snippet)",
         kernels.elementwise_source(1, [F16], F16, body=kernels.snippet_body("gelu_tanh")), ()),
        ("reduce.hip reduce_max int64", kernels.reduce_source("reduce_max", I64), ()),
        ("matmul.hip float16", kernels.matmul_source(F16), ()),
    ]
    out.extend((f"{k.name} (polyhal-gpu portable C)", k.source, ()) for k in portable_kernels())
    out.append(("storage_types.h (polyhal-gpu), every cast", storage_casts_source(), ()))
    if ALL:
        from polyhal_gpu.sorting import KEY_CTYPE

        exprs = tuple(f"sort_rows<{ctype}, {kind}>" for ctype in KEY_CTYPE.values() for kind in (0, 1, 2))
        out.append(("sort.cu, every key width and kind", compiler.source("sort.cu"), exprs))
    return out


def portable_kernels() -> list:
    """One instance of each op of polyhal-gpu's portable C (from the op's own sample), as
    polyhal-hip compiles it: the planned source, unchanged."""
    from polyhal.ops import OPS, resolve_attrs
    from polyhal.ir.types import TensorType
    from polyhal_gpu import portable

    out = []
    for op in sorted(portable.OPS):
        for seed in range(20):  # the first sample a portable kernel serves (not float16, ...)
            inputs, attrs = OPS[op].sample(np.random.default_rng(seed))
            attrs = resolve_attrs(op, attrs)
            wants = OPS[op].reference(*inputs, **attrs)
            try:
                out.append(portable.plan(op, attrs, tuple(TensorType(x.shape, x.dtype) for x in inputs),
                                         tuple(TensorType(w.shape, w.dtype) for w in wants), fp64=True))
                break
            except KernelNotFoundError:
                continue
        else:
            raise AssertionError(f"no sample of {op} has a portable kernel")
    return out


def storage_casts_source() -> str:
    """polyhal-gpu's storage conversions (C++ where CUDA compiles them; HIP holds no storage
    types, but hiprtc is the C++ GPU compiler CI has): a kernel for each cast to and from each
    storage type, as polyhal_gpu.storage writes it."""
    from polyhal.ir.types import STORAGE_DTYPES
    from polyhal_gpu import storage

    names = {"float32": "float", "float64": "double", "int8": "signed char", "int32": "int", "uint32": "unsigned int",
             "int64": "long long", "uint64": "unsigned long long", "bool": "bool"}
    ctype = {np.dtype(n): c for n, c in names.items()}
    ctype.update((d, "unsigned short" if d.itemsize == 2 else "unsigned char") for d in STORAGE_DTYPES)
    pairs = [(a, b) for a in ctype for b in ctype if a != b and (a in STORAGE_DTYPES or b in STORAGE_DTYPES)]
    return compiler.wrap(storage.source() + "".join(
        f'extern "C" __global__ void polyhal_cast{i}(const {ctype[a]}* x, {ctype[b]}* y) {{\n'
        f"  y[threadIdx.x] = ({ctype[b]})({storage.cast_expr(a, b, 'x[threadIdx.x]')});\n}}\n"
        for i, (a, b) in enumerate(pairs)))


@pytest.fixture(scope="module")
def compiled_by_arch():
    """Every architecture's compile of the representative sources, one child process per
    architecture, two at a time (CI has two cores); started on first use."""
    from concurrent.futures import ThreadPoolExecutor

    sources = representative_sources()
    jobs = [(text, label, exprs) for label, text, exprs in sources]
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {arch: pool.submit(compiler.compile_many_isolated, jobs, arch) for arch in ARCHS}
    yield sources, futures
    pool.shutdown(wait=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_source_compiles(real_compiler, compiled_by_arch, arch):
    sources, futures = compiled_by_arch
    results = futures[arch].result()
    failures = [f"{label}: {r}" for (label, _t, _e), r in zip(sources, results) if isinstance(r, Exception)]
    assert not failures, "\n\n".join(failures)
    for (label, _text, exprs), result in zip(sources, results):
        assert compiler.is_code_object(result.code), label
        assert compiler.code_object_arch(result.code) == arch, f"{label}: code object for {compiler.code_object_arch(result.code)}"
        for e in exprs:
            lowered = result.lowered[e]
            assert lowered.startswith("_Z") and lowered.encode() + b"\0" in result.code, f"{label}: {e} -> {lowered}"
        if not exprs:
            assert (b"polyhal_" in result.code or b"nms_" in result.code
                    or label.split(" ")[0].encode() + b"\0" in result.code), label


def test_unknown_architecture_aborts_only_the_child(real_compiler):
    """ROCm 5.2's hiprtc aborts the process for gfx942; the isolated compile reports it."""
    from polyhal_hip.runtime import version_tuple

    if version_tuple(real_compiler.runtime_version())[0] != 5:
        pytest.skip("the abort is a ROCm 5.x behaviour")
    with pytest.raises(HipCompileError, match=r"aborted \(signal") as info:
        compiler.compile_isolated(compiler.source("rowwise.cu"), "rowwise.cu", "gfx942", rowwise.EXPRESSIONS[:1])
    assert info.value.arch == "gfx942"


def test_a_kernel_that_fails_to_compile_raises_with_the_log(real_compiler):
    text = compiler.wrap('extern "C" __global__ void broken(float* x) { x[0] = not_declared_anywhere; }')
    with pytest.raises(HipCompileError) as info:
        compiler.worker().compile(text, "broken.hip", compiler.options_for("gfx90a"))
    exc = info.value
    assert "not_declared_anywhere" in exc.log and "undeclared identifier" in exc.log
    assert "compiler log" in str(exc) and "broken.hip" in str(exc) and exc.arch == "gfx90a"
    assert isinstance(exc, KernelNotFoundError)  # to the core: a kernel the device does not have


def test_the_worker_survives_what_kills_hiprtc(real_compiler):
    """The default compile worker: a compiler abort (ROCm 5.2, gfx942) kills the child only,
    the error says so, and the next compile starts a new worker."""
    from polyhal_hip.runtime import version_tuple

    w = compiler.CompileWorker()
    try:
        good = w.compile(compiler.source("rowwise.cu"), "rowwise.cu", compiler.options_for("gfx90a"),
                         rowwise.EXPRESSIONS[:1])
        assert compiler.code_object_arch(good.code) == "gfx90a" and w.started == 1
        if version_tuple(real_compiler.runtime_version())[0] == 5:
            with pytest.raises(HipCompileError, match="worker died") as info:
                w.compile(compiler.source("rowwise.cu"), "rowwise.cu", compiler.options_for("gfx942"))
            assert info.value.arch == "gfx942"
            again = w.compile(compiler.source("rowwise.cu"), "rowwise.cu", compiler.options_for("gfx1030"),
                              rowwise.EXPRESSIONS[:1])
            assert compiler.code_object_arch(again.code) == "gfx1030" and w.started == 2
    finally:
        w.close()


def test_the_real_runtime_compiles_through_the_worker(real_compiler, monkeypatch, tmp_path):
    monkeypatch.setenv("POLYHAL_HIP_CACHE_DIR", "off")
    c = compiler.Compiler(real_compiler)
    assert c._backend() is compiler.worker()
    monkeypatch.setenv("POLYHAL_HIP_COMPILE", "inprocess")
    assert c._backend() is real_compiler
    monkeypatch.setenv("POLYHAL_HIP_COMPILE", "threads")
    with pytest.raises(ConfigError, match="POLYHAL_HIP_COMPILE='threads' is not one of process, inprocess"):
        c._backend()


class CountingRuntime(Runtime):
    """Compiles nothing: returns a fake code object and counts calls (cache tests)."""

    def __init__(self, version: int = 60241133) -> None:
        self.version, self.count = version, 0

    def runtime_version(self) -> int:
        return self.version

    def compile(self, source, name, options, expressions=()):
        self.count += 1
        return CompileResult(b"\x7fELF" + source.encode(), {e: f"_Z{e}" for e in expressions}, "")


def test_cache_by_source_options_arch_and_runtime_version(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYHAL_HIP_CACHE_DIR", str(tmp_path))
    rt = CountingRuntime()
    c = compiler.Compiler(rt)
    a = c.compile("k1", "k.hip", "gfx90a", ("f<int>",))
    assert c.compile("k1", "k.hip", "gfx90a", ("f<int>",)) is a and rt.count == 1
    c.compile("k2", "k.hip", "gfx90a")
    c.compile("k1", "k.hip", "gfx1030", ("f<int>",))
    c.compile("k1", "k.hip", "gfx90a", ("f<int>",), extra_options=("-O1",))
    assert rt.count == 4
    # a new process (new Compiler) loads the code objects from disk
    rt2 = CountingRuntime()
    again = compiler.Compiler(rt2).compile("k1", "k.hip", "gfx90a", ("f<int>",))
    assert rt2.count == 0 and again.code == a.code and again.lowered == a.lowered
    # another runtime version compiles again
    rt3 = CountingRuntime(version=60300000)
    compiler.Compiler(rt3).compile("k1", "k.hip", "gfx90a", ("f<int>",))
    assert rt3.count == 1


def test_failed_compiles_are_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("POLYHAL_HIP_CACHE_DIR", str(tmp_path))

    class Failing(CountingRuntime):
        def compile(self, source, name, options, expressions=()):
            self.count += 1
            raise HipCompileError("no", log="error: no")

    rt = Failing()
    c = compiler.Compiler(rt)
    for _ in range(2):
        with pytest.raises(HipCompileError):
            c.compile("bad", "bad.hip", "gfx90a")
    assert rt.count == 2 and not list(tmp_path.iterdir())


def test_cache_key_parts():
    base = compiler.cache_key("src", ("-O3",), "gfx90a", 50221153, ())
    assert base != compiler.cache_key("src2", ("-O3",), "gfx90a", 50221153, ())
    assert base != compiler.cache_key("src", ("-O2",), "gfx90a", 50221153, ())
    assert base != compiler.cache_key("src", ("-O3",), "gfx908", 50221153, ())
    assert base != compiler.cache_key("src", ("-O3",), "gfx90a", 60241133, ())
    assert base == compiler.cache_key("src", ("-O3",), "gfx90a", 50221153, ())


def test_the_disk_cache_trusts_only_what_it_stored(tmp_path, monkeypatch):
    """A code object that differs from the sha256 recorded when it was stored (corrupt, or
    planted) is compiled again; a folder others may write is not used at all (issue 27)."""
    from polyhal.codecache import CacheWarning

    monkeypatch.setenv("POLYHAL_HIP_CACHE_DIR", str(tmp_path / "hip"))
    good = compiler.Compiler(CountingRuntime()).compile("k1", "k.hip", "gfx90a")
    (code,) = (tmp_path / "hip").glob("*.co")
    assert oct(code.stat().st_mode & 0o777) == "0o600" and oct((tmp_path / "hip").stat().st_mode & 0o777) == "0o700"
    code.write_bytes(b"\x7fELF planted")
    rt = CountingRuntime()
    with pytest.warns(CacheWarning, match="sha256|bytes where"):
        again = compiler.Compiler(rt).compile("k1", "k.hip", "gfx90a")
    assert rt.count == 1 and again.code == good.code  # compiled again, and stored over it
    (tmp_path / "hip").chmod(0o777)
    rt = CountingRuntime()
    with pytest.warns(CacheWarning, match="world-writable"):
        compiler.Compiler(rt).compile("k1", "k.hip", "gfx90a")
    assert rt.count == 1
