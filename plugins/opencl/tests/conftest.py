"""Fixtures of the OpenCL backend's tests.

Every test that needs a device skips, saying why, when no OpenCL device is registered. The
conformance suite (``test_conformance.py``) runs here on the OpenCL devices only, unless
``--polyhal-backend``/``--polyhal-device`` choose otherwise: this directory tests this backend,
and the CPU backend's run belongs to its own tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import polyhal

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install pyopencl)")

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("polyhal_backend", None) or config.getoption("polyhal_device", None):
        return
    keep, drop = [], []
    for item in items:
        name = getattr(getattr(item, "callspec", None), "params", {}).get("device_name")
        mine = _HERE in Path(str(item.path)).parents
        (drop if mine and name is not None and not name.startswith("opencl:") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def cl_spec() -> polyhal.DeviceSpec:
    """The spec of the first OpenCL device; skips when there is none."""
    specs = [s for s in polyhal.devices() if s.backend == "opencl"]
    if not specs:
        from polyhal_opencl.plugin import enumerate_devices

        pytest.skip("no OpenCL device: " + "; ".join(enumerate_devices().reasons or ("none registered",)))
    return specs[0]


@pytest.fixture(scope="session")
def dev(cl_spec):
    """The first OpenCL device, created (context, queue) once for the session."""
    return polyhal.get_device(cl_spec.name)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def run_prepared(dev):
    """``run(fn, inputs, out_types) -> [numpy outputs]``: upload ``inputs``, call a prepared
    kernel on the native arrays of inputs and fresh outputs, and read the outputs back."""
    def run(fn, inputs, out_types):
        ins = [polyhal.asarray(x, device=dev) for x in inputs]
        outs = [polyhal.empty(t.shape, t.dtype, dev) for t in out_types]
        fn(*[t.native for t in ins + outs])
        return [o.numpy() for o in outs]
    return run
