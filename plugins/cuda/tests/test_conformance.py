"""The core's conformance suite on the CUDA devices: run it with ``--polyhal-backend=cuda``
(without a GPU every test here skips, saying why)."""

import pytest

import polyhal

if not any(s.backend == "cuda" for s in polyhal.devices()):
    pytest.skip("no CUDA device: " + "; ".join(polyhal.default_registry().unavailable_reasons().get("cuda", [])),
                allow_module_level=True)

from polyhal.testing.conformance import *  # noqa: F401,F403,E402
