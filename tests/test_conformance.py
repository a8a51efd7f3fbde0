"""Runs the core's conformance suite on every device discovered in this environment."""

from polyhal.testing.conformance import *  # noqa: F401,F403
