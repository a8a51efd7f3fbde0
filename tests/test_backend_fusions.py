"""Backends claim fusions (polyhal.hal.kernels.KernelTable.define, register_passes, Target's
claim check): a backend's own ops and the fusion passes that create them live in the backend,
as onnxruntime's execution providers claim the nodes they fuse.

The backends here are real plugin distributions (installed with their entry point, discovered
by a fresh registry): ``fusedev`` runs ``add``, ``relu`` and its own ``fusedev.add_relu``, and
claims the fusion of ``relu(add(x, y))``; ``claimdev`` claims fusions into ops it has no kernel
for.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import polyhal
from polyhal import KernelTable, PluginError
from polyhal.ops import OPS, core_ops

CORE = Path(polyhal.__file__).parent

#: A backend with an op of its own and the fusion pass that creates it (the CPU device under
#: another name, with a kernel table of its own).
FUSEDEV = '''
import dataclasses

import numpy as np

import polyhal
from polyhal import Fusion, KernelTable, PassRegistration, fusion_pass
from polyhal.ir.program import Op, consumers_of
from polyhal.ops import OPS
from polyhal_cpu.allocator import host_heap
from polyhal_cpu.device import CPUDevice

POLYHAL_API_VERSION = polyhal.API_VERSION
TABLE = KernelTable("fusedev")


def _infer(x, y):
    return OPS["relu"].infer(OPS["add"].infer((x, y)))


def _reference(x, y):
    return (np.maximum(np.asarray(x, np.float64) + y, 0).astype(x.dtype),)


def _sample(rng):
    shape = tuple(int(d) for d in rng.integers(1, 6, size=2))
    return [rng.uniform(-2, 2, shape).astype(np.float32), rng.uniform(-2, 2, shape).astype(np.float32)], {}


ADD_RELU = TABLE.define("fusedev.add_relu", infer=_infer, reference=_reference, sample=_sample, arity=2,
                        doc="relu(x + y), one pass").name
calls = []


@TABLE.register("add")
def _add(device, op, attrs, ins, outs, scratch):
    return lambda x, y, out: np.add(x, y, out=out)


@TABLE.register("relu")
def _relu(device, op, attrs, ins, outs, scratch):
    return lambda x, out: np.maximum(x, 0, out=out)


@TABLE.register(ADD_RELU)
def _add_relu(device, op, attrs, ins, outs, scratch):
    def kernel(x, y, out):
        calls.append(op)
        np.maximum(np.add(x, y, out=out), 0, out=out)
    return kernel


class FuseDevice(CPUDevice):
    kernels = TABLE


def fuse_add_relu(program, fusible):
    """relu(add(x, y)) into fusedev.add_relu where the device has its kernel."""
    readers = consumers_of(program)
    fused, dropped, changes = {}, set(), []
    for op in program.ops:
        users = readers.get(op.outputs[0].id, []) if op.name == "add" else []
        if len(users) == 1 and users[0].name == "relu" and fusible(ADD_RELU, (op, users[0])):
            fused[id(users[0])] = Op("dispatch", ADD_RELU, op.inputs, users[0].outputs, (), op.affinity)
            dropped.add(id(op))
            changes.append(Fusion("add_relu", (op, users[0]), (fused[id(users[0])],)))
    ops = [fused.get(id(op), op) for op in program.ops if id(op) not in dropped]
    return dataclasses.replace(program, ops=ops), changes


@polyhal.hookimpl
def register_devices():
    return [polyhal.DeviceSpec(name="fusedev:0", backend="fusedev", rank=-100, factory=FuseDevice,
                               heaps=(host_heap(),), kernel_names=TABLE.kernel_names)]


@polyhal.hookimpl
def register_passes():
    return [PassRegistration(fusion_pass("fusedev-add-relu", fuse_add_relu, creates=(ADD_RELU,),
                                         provides="fusedev-add-relu-fused"), after="pool-before-pointwise-conv")]
'''

#: A backend that claims fusions into ops it cannot run: one it defines but has no kernel for,
#: and one nobody defines.
CLAIMDEV = '''
import polyhal
from polyhal import KernelTable, PassRegistration, fusion_pass
from polyhal_cpu.allocator import host_heap
from polyhal_cpu.device import CPUDevice

POLYHAL_API_VERSION = polyhal.API_VERSION
TABLE = KernelTable("claimdev")
TABLE.define("claimdev.mul_add", infer=lambda x, y, z: (x,), reference=lambda x, y, z: (x * y + z,),
             sample=lambda rng: ([], {}), arity=3)
TABLE.register("add")(lambda device, op, attrs, ins, outs, scratch: lambda x, y, out: None)
ran = []


class ClaimDevice(CPUDevice):
    kernels = TABLE


def greedy(program, fusible):
    """Fuse what no kernel runs."""
    ran.append(program.name)
    return program, []


@polyhal.hookimpl
def register_devices():
    return [polyhal.DeviceSpec(name="claimdev:0", backend="claimdev", rank=-100, factory=ClaimDevice,
                               heaps=(host_heap(),), kernel_names=TABLE.kernel_names)]


@polyhal.hookimpl
def register_passes():
    return [PassRegistration(fusion_pass("claimdev-mul-add", greedy, creates=("claimdev.mul_add",), provides="a"),
                             after="fuse-linear"),
            PassRegistration(fusion_pass("claimdev-ghost", greedy, creates=("claimdev.ghost",), provides="b"),
                             after="fuse-linear"),
            PassRegistration(fusion_pass("claimdev-add", greedy, creates=("add",), provides="c"), after="fuse-linear")]
'''


def _add_relu() -> polyhal.Program:
    b = polyhal.ProgramBuilder("add_relu")
    x, y = b.input("x", (3, 4)), b.input("y", (3, 4))
    b.output(b.relu(b.add(x, y)))
    return b.build()


def _feeds():
    rng = np.random.default_rng(1)
    return rng.standard_normal((3, 4), dtype=np.float32), rng.standard_normal((3, 4), dtype=np.float32)


def _ops(plan) -> list[str]:
    return [op.name for op in plan.program.ops]


def test_a_backend_fuses_into_its_own_op_where_its_kernel_is(install_plugin, fresh_registry):
    module = install_plugin("fusedev", FUSEDEV)
    registry = fresh_registry()
    plan = polyhal.compile(_add_relu(), "fusedev:0", registry=registry)
    assert _ops(plan) == ["fusedev.add_relu"]
    explained = plan.explain()
    assert "fusedev-add-relu:" in explained and "fused add_relu: add + relu -> fusedev.add_relu" in explained
    x, y = _feeds()
    np.testing.assert_allclose(plan.run_numpy(x, y)[0], np.maximum(x + y, 0), rtol=1e-6)
    assert sys.modules[module].calls == ["fusedev.add_relu"]  # its own kernel ran
    # The pass runs in every compile, but a fused op lands only where its kernel is: not on the CPU.
    on_cpu = polyhal.compile(_add_relu(), "cpu:0", registry=registry)
    assert _ops(on_cpu) == ["add", "relu"] and "fusedev-add-relu:" in on_cpu.explain()
    np.testing.assert_allclose(on_cpu.run_numpy(x, y)[0], np.maximum(x + y, 0), rtol=1e-6)
    assert _ops(polyhal.compile(_add_relu(), "fusedev:0", registry=registry, fuse=False)) == ["add", "relu"]
    # and the CPU's own fusion asks the same gate: nowhere but on a CPU
    program = _scale_shift_then_conv()
    ops = program.ops
    assert polyhal.Target.build(registry, ["cpu:0"]).fusible("cpu.scale_shift_conv", ops)
    assert not polyhal.Target.build(registry, ["fusedev:0"]).fusible("cpu.scale_shift_conv", ops)


def _scale_shift_then_conv() -> polyhal.Program:
    rng = np.random.default_rng(2)
    b = polyhal.ProgramBuilder("prologue")
    x = b.input("x", (1, 4, 6, 6))
    c = b.constant(rng.standard_normal(4).astype(np.float32))
    n = b.op("scale_shift", x, c, c, activation="relu", alpha=0.0, beta=0.0)
    b.output(b.op("conv", n, b.constant(rng.standard_normal((4, 4, 1, 1)).astype(np.float32))))
    return b.build()


def test_the_cpu_claims_its_conv_prologue(monkeypatch):
    monkeypatch.setenv("POLYHAL_CPU_ONEDNN", "0")  # with oneDNN's convs (no prologue) the CPU claims none
    plan = polyhal.compile(_scale_shift_then_conv(), "cpu:0")
    assert _ops(plan) == ["cpu.scale_shift_conv"]
    assert "cpu-fuse-conv-prologue:" in plan.explain() and "-> cpu.scale_shift_conv" in plan.explain()
    x = np.random.default_rng(3).standard_normal((1, 4, 6, 6)).astype(np.float32)
    want = polyhal.compile(_scale_shift_then_conv(), "cpu:0", fuse=False).run_numpy(x)[0]
    np.testing.assert_allclose(plan.run_numpy(x)[0], want, rtol=1e-5, atol=1e-5)


def test_a_claim_without_a_kernel_is_refused_and_the_compile_goes_on(install_plugin, fresh_registry):
    module = install_plugin("claimdev", CLAIMDEV)
    registry = fresh_registry()
    registry.load_backends()  # as listing the devices does: its claims join every compile from then on
    with pytest.warns(RuntimeWarning) as caught:
        plan = polyhal.compile(_add_relu(), "cpu:0", registry=registry)
    messages = [str(w.message) for w in caught]
    [defined] = [m for m in messages if "'claimdev-mul-add'" in m]
    assert "plugin 'claimdev' is left out" in defined and "claims a fusion into 'claimdev.mul_add'" in defined
    assert "no device of plugin 'claimdev' has a kernel for 'claimdev.mul_add'" in defined
    assert "@TABLE.register" in defined and "claimdev:0" in defined
    [undefined] = [m for m in messages if "'claimdev-ghost'" in m]
    assert "'claimdev.ghost' is not defined" in undefined and "TABLE.define" in undefined
    assert not any("'claimdev-add'" in m for m in messages)  # it has a kernel for what it claims
    names = [r.name for r in plan.compilation.records]
    assert "claimdev-add" in names and "claimdev-mul-add" not in names and "claimdev-ghost" not in names
    assert sys.modules[module].ran == ["add_relu"]  # only the pass it can serve ran
    x, y = _feeds()
    np.testing.assert_allclose(plan.run_numpy(x, y)[0], np.maximum(x + y, 0), rtol=1e-6)


#: (backend, op it defines, what the refusal says): names outside the namespace, a core op's
#: name, another backend's op, a second plugin with the CPU's backend name.
REFUSED_NAMES = [
    ("mine", "other.thing", r"mine \(.*test_backend_fusions\): cannot define op 'other\.thing': a backend's own op "
                            r"is named 'mine\.<name>'$"),
    ("mine", "conv", r"cannot define op 'conv': a backend's own op is named 'mine\.<name>'; 'conv' is the core "
                     r"\(polyhal\.ops\.nn\)'s"),
    ("mine", "mine.conv", r"cannot define op 'mine\.conv': it would shadow the core \(polyhal\.ops\.nn\)'s op "
                          r"'conv'; register a kernel for 'conv'"),
    ("mine", "cpu.blocked_conv", r"a backend's own op is named 'mine\.<name>'; 'cpu\.blocked_conv' is backend 'cpu' "
                                 r"\(polyhal_cpu\.ops\)'s"),
    ("cpu", "cpu.scale_shift_conv", r"cpu \(.*test_backend_fusions\): cannot define op 'cpu\.scale_shift_conv': it is "
                                    r"already backend 'cpu' \(polyhal_cpu\.ops\)'s; two plugins share"),
]


@pytest.mark.parametrize("backend, name, refusal", REFUSED_NAMES)
def test_a_backend_op_name_outside_its_namespace_or_taken_is_refused(backend, name, refusal):
    import polyhal_cpu.ops  # noqa: F401  (defines the CPU's own ops)

    with pytest.raises(PluginError, match=refusal):
        KernelTable(backend).define(name, infer=lambda x: (x,), reference=lambda x: (x,),
                                    sample=lambda rng: ([], {}), arity=1)


def test_a_table_serves_core_ops_and_its_own():
    import polyhal_cpu.ops

    with pytest.raises(PluginError, match=r"cannot register a kernel for 'cpu\.blocked_conv': it is backend 'cpu' "
                                          r"\(polyhal_cpu\.ops\)'s own op"):
        KernelTable("mine").register("cpu.blocked_conv")(lambda *a: None)
    # the module that defined an op may define it again (a plugin imported anew)
    before = OPS["cpu.blocked_conv"]
    importlib.reload(polyhal_cpu.ops)
    assert OPS["cpu.blocked_conv"] is not before and OPS["cpu.blocked_conv"].backend == "cpu"
    # a fallback serves the core op set, never a backend's own op
    table = KernelTable("mine", fallback=lambda *a: (lambda *arrays: None))
    assert table.kernel_names == frozenset(n for n, d in core_ops().items() if not d.fused)
    with pytest.raises(polyhal.KernelNotFoundError, match="no kernel for op 'cpu.blocked_conv'"):
        table.prepare(None, "cpu.blocked_conv", {}, (), ())
    assert OPS["cpu.blocked_conv"].backend == "cpu" and "cpu.blocked_conv" not in core_ops()


def test_core_code_names_no_backend_op():
    """The core op set is what every backend could serve: no core module names a backend's own
    op (nor its name without the namespace)."""
    import polyhal_cpu.ops  # noqa: F401
    import polyhal_cuda.kernels  # noqa: F401  (importable without a GPU)

    own = {n for n, d in OPS.items() if d.backend in ("cpu", "cuda", "opencl", "hip")}  # polyhal's own backends
    assert {"cpu.scale_shift_conv", "cpu.blocked_conv", "cuda.blocked_conv"} <= own
    words = re.compile(r"\b(" + "|".join(sorted({re.escape(n.split(".", 1)[1]) for n in own})) + r")\b")
    found = [f"{path.relative_to(CORE)}:{i}: {line.strip()}" for path in sorted(CORE.rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if words.search(line)]
    assert not found, "core code names backend ops:\n" + "\n".join(found)


def test_the_conformance_suite_checks_backend_ops(install_plugin, tmp_path):
    """A backend's own op is checked against its reference on the backend's devices, as a core
    op is: fusedev's add_relu, the CPU's conv with a prologue and its channel-blocked conv."""
    install_plugin("fusedev", FUSEDEV)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "polyhal.testing.conformance", "-q", "-rs",
                          "-p", "no:cacheprovider", "--polyhal-backend=fusedev", "--polyhal-backend=cpu", "-k",
                          "kernel_matches_reference and (add_relu or scale_shift_conv or blocked_conv)"],
                         capture_output=True, text=True, env=env, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "3 passed" in out, out
    assert "cpu:0 has no kernel for fusedev.add_relu" in out and "fusedev:0 has no kernel for cpu.blocked_conv" in out


def test_a_fusion_pass_without_a_docstring_has_an_empty_description():
    # the pipeline's helper took the first line of the function's docstring unguarded (IndexError)
    p = polyhal.fusion_pass("undocumented", lambda program, fusible: (program, []), provides="nothing")
    assert p.description == "" and p.enabled(polyhal.Target.build(polyhal.default_registry(), ["cpu:0"]))
