"""The compile Target and the declared pass pipeline (polyhal.target, polyhal.passes.pipeline)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import polyhal
from polyhal import DEFAULT_PIPELINE, Pass, PassRegistration, PipelineError, Target
from polyhal.passes.pipeline import pipeline_for

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _mlp() -> polyhal.Program:
    b = polyhal.ProgramBuilder("mlp")
    x, w, bias = b.input("x", (4, 8)), b.input("w", (8, 8)), b.input("b", (8,))
    b.output(b.relu(b.add(b.matmul(x, w), bias)))
    return b.build()


def _feeds():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((4, 8), dtype=np.float32), rng.standard_normal((8, 8), dtype=np.float32),
            rng.standard_normal(8, dtype=np.float32))


def _reference(x, w, b):
    return np.maximum(x @ w + b, 0)


def test_the_default_pipeline_is_declared_in_order_and_valid():
    names = DEFAULT_PIPELINE.names
    DEFAULT_PIPELINE.validate()
    assert names[:2] == ["decompose", "fuse-quantized"] and names[-3:] == ["place", "materialize-encodings", "bufferize"]
    assert names.index("fuse-attention") < names.index("fuse-linear") < names.index("precision")
    assert all(p.description for p in DEFAULT_PIPELINE), "every pass says what it does"


def test_explain_lists_each_pass_with_its_time_and_what_it_changed():
    plan = polyhal.compile(_mlp(), "cpu:0")
    records = {r.name: r for r in plan.compilation.records}
    # the default pipeline, with the CPU plugin's own fusion (register_passes) after the core's, and its
    # account of the convs and matmuls oneDNN runs after bufferize
    assert list(records) == pipeline_for(polyhal.default_registry()).names
    assert [n for n in records if n not in DEFAULT_PIPELINE.names] == ["cpu-fuse-conv-prologue", "cpu-onednn-int8-report",
                                                                          "cpu-onednn-report"]
    assert list(records).index("cpu-fuse-conv-prologue") == list(records).index("pool-before-pointwise-conv") + 1
    assert records["fuse-linear"].ops_before == 3 and records["fuse-linear"].ops_after == 2
    assert "1 rewrites" in records["fuse-linear"].detail
    text = plan.explain()
    assert "passes (18 run," in text and "fuse-linear:" in text and "3 -> 2 ops" in text
    np.testing.assert_allclose(plan.run_numpy(*_feeds())[0], _reference(*_feeds()), rtol=1e-5, atol=1e-5)


def test_fuse_false_lists_the_fusion_passes_as_skipped():
    plan = polyhal.compile(_mlp(), "cpu:0", fuse=False)
    skipped = [r.name for r in plan.compilation.records if not r.ran]
    assert "fuse-linear" in skipped and "place" not in skipped
    assert "10 passes skipped (compile(fuse=False))" in plan.explain()
    assert "fuse-linear" not in plan.explain()


def test_a_user_pass_inserted_after_another_runs_there_and_sees_the_target():
    seen = {}

    def count_matmuls(compilation, target):
        """Count the matmuls left after linear fusion."""
        seen["devices"] = target.devices
        seen["kernels"] = "matmul" in target.kernels("cpu:0")
        n = sum(op.name == "matmul" for op in compilation.program.ops)
        compilation.notes.append(f"{n} matmuls left")

    pipeline = DEFAULT_PIPELINE.insert(Pass("count-matmuls", count_matmuls, requires=("unplaced",)),
                                       after="fuse-linear")
    assert pipeline.names.index("count-matmuls") == pipeline.names.index("fuse-linear") + 1
    assert "count-matmuls" not in DEFAULT_PIPELINE.names  # pipelines are immutable
    plan = polyhal.compile(_mlp(), "cpu:0", pipeline=pipeline)
    assert seen == {"devices": ("cpu:0",), "kernels": True}
    assert "note: 0 matmuls left" in plan.explain()  # fuse-linear took the matmul and the add
    np.testing.assert_allclose(plan.run_numpy(*_feeds())[0], _reference(*_feeds()), rtol=1e-5, atol=1e-5)


def test_a_pass_that_rewrites_the_program_changes_the_plan():
    def relu_to_abs(compilation, target):
        """Every relu becomes abs (a test rewrite)."""
        import dataclasses
        ops = [dataclasses.replace(op, name="abs") if op.name == "relu" else op for op in compilation.program.ops]
        compilation.program = dataclasses.replace(compilation.program, ops=ops)

    pipeline = DEFAULT_PIPELINE.insert(Pass("relu-to-abs", relu_to_abs, requires=("unplaced",)),
                                       before="fold-constant-transposes")
    plan = polyhal.compile(_mlp(), "cpu:0", pipeline=pipeline, fuse=False)
    x, w, b = _feeds()
    np.testing.assert_allclose(plan.run_numpy(x, w, b)[0], np.abs(x @ w + b), rtol=1e-5, atol=1e-5)


def test_a_pass_with_an_unmet_requirement_is_refused_naming_both_passes():
    needs_placement = Pass("count-transfers", lambda c, t: None, requires=("placed",))
    with pytest.raises(PipelineError, match=r"'count-transfers' requires 'placed': pass 'place' provides it, "
                                            r"but runs later; move 'count-transfers' after 'place'"):
        DEFAULT_PIPELINE.insert(needs_placement, after="fuse-gelu")
    rewrite = Pass("late-rewrite", lambda c, t: None, requires=("unplaced",))
    with pytest.raises(PipelineError, match=r"'late-rewrite' requires 'unplaced': pass 'place' \(earlier\) ends it"):
        DEFAULT_PIPELINE.insert(rewrite, after="materialize-encodings")
    with pytest.raises(PipelineError, match=r"'materialize-encodings' requires 'placed'.*no pass of the pipeline provides it"):
        DEFAULT_PIPELINE.remove("place")
    with pytest.raises(PipelineError, match="no pass named 'nope' to insert after"):
        DEFAULT_PIPELINE.insert(rewrite, after="nope")
    with pytest.raises(PipelineError, match="more than once"):
        DEFAULT_PIPELINE.insert(Pass("place", lambda c, t: None), after="bufferize")
    with pytest.raises(PipelineError, match="exactly one of after= or before="):
        DEFAULT_PIPELINE.insert(rewrite)
    with pytest.raises(PipelineError, match="tuple of property names"):
        Pass("bad", lambda c, t: None, requires="placed")


def test_a_failing_pass_names_itself():
    def broken(compilation, target):
        raise RuntimeError("boom")

    pipeline = DEFAULT_PIPELINE.insert(Pass("broken", broken), after="place")
    with pytest.raises(RuntimeError, match="boom") as info:
        polyhal.compile(_mlp(), "cpu:0", pipeline=pipeline)
    if sys.version_info >= (3, 11):
        assert "(in compile pass 'broken')" in info.value.__notes__


def test_the_target_is_built_once_per_compile_from_the_registry():
    registry = polyhal.default_registry()
    target = Target.build(registry, ("cpu:0",), precision="tf32")
    assert target.devices == ("cpu:0",) and target.precision == "tf32" and target.precision_source == "precision="
    assert "matmul" in target.kernels("cpu:0")
    assert target.chosen_device(_mlp().ops[:1]) == "cpu:0"
    assert target.fusible("linear", _mlp().ops[:2])
    with pytest.raises(polyhal.PrecisionError):
        Target.build(registry, ("cpu:0",), precision="fp7")


def test_passes_take_the_target_not_the_registry():
    import inspect

    from polyhal.passes import bufferize, materialize_encoding, placement
    for fn in (placement.place, materialize_encoding.materialize_encodings, bufferize.bufferize):
        params = list(inspect.signature(fn).parameters)
        assert "registry" not in params and "target" in params, fn


class _PassPlugin:
    """A policy plugin that adds a compile pass through the register_passes hook."""

    POLYHAL_API_VERSION = polyhal.API_VERSION

    def __init__(self, registration):
        self.registration = registration
        self.ran = 0

    @polyhal.hookimpl
    def register_passes(self):
        return [self.registration]


def test_a_plugin_adds_a_pass_to_every_compile(fresh_registry):
    registry = fresh_registry(POLYHAL_BACKENDS="cpu")
    plugin = _PassPlugin(None)

    def mark(compilation, target):
        """Count the compiles."""
        plugin.ran += 1

    plugin.registration = PassRegistration(Pass("plugin-mark", mark, requires=("placed",)), after="place")
    registry.register(plugin, name="pass-plugin")
    plan = polyhal.compile(_mlp(), "cpu:0", registry=registry)
    assert plugin.ran == 1 and "plugin-mark:" in plan.explain()
    polyhal.compile(_mlp(), "cpu:0", registry=registry)
    assert plugin.ran == 2
    registry.unregister(name="pass-plugin")
    plan = polyhal.compile(_mlp(), "cpu:0", registry=registry)
    assert plugin.ran == 2 and "plugin-mark" not in plan.explain()


def test_a_plugin_pass_that_cannot_go_where_it_asks_is_left_out_with_a_warning(fresh_registry):
    registry = fresh_registry(POLYHAL_BACKENDS="cpu")
    bad = _PassPlugin(PassRegistration(Pass("too-early", lambda c, t: None, requires=("placed",)),
                                       before="fuse-linear"))
    junk = _PassPlugin("not a registration")
    registry.register(bad, name="bad-pass-plugin")
    registry.register(junk, name="junk-pass-plugin")
    with pytest.warns(RuntimeWarning) as caught:
        plan = polyhal.compile(_mlp(), "cpu:0", registry=registry)
    messages = " ".join(str(w.message) for w in caught)
    assert "plugin 'bad-pass-plugin' is left out" in messages and "'too-early' requires 'placed'" in messages
    assert "plugin 'junk-pass-plugin' is left out" in messages and "PassRegistration" in messages
    np.testing.assert_allclose(plan.run_numpy(*_feeds())[0], _reference(*_feeds()), rtol=1e-5, atol=1e-5)


def test_a_plugin_whose_register_passes_raises_is_recorded_and_compiles_go_on(fresh_registry):
    registry = fresh_registry(POLYHAL_BACKENDS="cpu")

    class Raising:
        POLYHAL_API_VERSION = polyhal.API_VERSION

        @polyhal.hookimpl
        def register_passes(self):
            raise ValueError("no passes today")

    registry.register(Raising(), name="raising-pass-plugin")
    with pytest.warns(RuntimeWarning, match="'raising-pass-plugin' adds no compile passes"):
        plan = polyhal.compile(_mlp(), "cpu:0", registry=registry)
    assert any(f.plugin == "raising-pass-plugin" and "no passes today" in f.reason for f in registry.failures)
    np.testing.assert_allclose(plan.run_numpy(*_feeds())[0], _reference(*_feeds()), rtol=1e-5, atol=1e-5)


def test_polyhal_run_profile_prints_the_compile_passes():
    run = subprocess.run([sys.executable, "-m", "polyhal.cli", "run", str(EXAMPLES / "mlp.onnx"), "--profile",
                          "--device", "cpu:0", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    passes = json.loads(run.stdout)["profile"]["passes"]
    assert [p["name"] for p in passes if not p["name"].startswith("cpu-")] == DEFAULT_PIPELINE.names
    assert all(p["seconds"] >= 0 for p in passes)


def test_every_core_fusion_pass_declares_what_it_creates():
    fusions = [p for p in DEFAULT_PIPELINE if p.disabled_by]
    assert fusions and all(p.creates for p in fusions)


def test_a_fusion_pass_that_makes_an_op_it_does_not_claim_is_refused():
    import dataclasses

    from polyhal import Fusion, fusion_pass

    def relu_to_gelu(program, fusible):
        """Every relu becomes a gelu (claims only abs)."""
        ops, done = [], []
        for op in program.ops:
            if op.name == "relu":
                new = dataclasses.replace(op, name="gelu", attrs=(("approximate", "none"),))
                done.append(Fusion("test", (op,), (new,)))
                op = new
            ops.append(op)
        return dataclasses.replace(program, ops=ops), done

    p = fusion_pass("relu-to-gelu", relu_to_gelu, provides="relu-gone", creates=("abs",))
    pipeline = DEFAULT_PIPELINE.insert(p, after="fuse-gelu")
    with pytest.raises(PipelineError, match=r"'relu-to-gelu' created \['gelu'\], which it does not claim"):
        polyhal.compile(_mlp(), "cpu:0", pipeline=pipeline)
