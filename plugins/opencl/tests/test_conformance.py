"""The core's conformance suite, run on the OpenCL devices (``--polyhal-backend=opencl`` selects
only them; without it the suite runs on every discovered device)."""

from polyhal.testing.conformance import *  # noqa: F401,F403
