"""pytest plugin of the conformance suite: options and per-device parametrization.

Kept import-light (polyhal is imported only when a test asks for a device), because pytest
loads it in every session once polyhal is installed.

A backend author runs the suite on their devices with::

    pytest --pyargs polyhal.testing.conformance --polyhal-backend=mydev

It also gives every test session the ``fresh_registry`` fixture, for plugin tests that need the
registry rebuilt under a given environment.
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("polyhal", "polyhal conformance suite")
    group.addoption("--polyhal-backend", action="append", default=[], metavar="NAME",
                    help="run device tests only on devices of this backend (repeatable)")
    group.addoption("--polyhal-device", action="append", default=[], metavar="NAME",
                    help="run device tests only on this device (repeatable)")


def session_seed() -> int:
    """The base seed of this session's random samples: ``POLYHAL_SEED`` if set, else drawn once
    (and then kept in ``POLYHAL_SEED``, so that the header shows it and subprocesses share it)."""
    from polyhal.testing.settings import TestSettings

    seed = TestSettings.from_env().seed
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
        os.environ["POLYHAL_SEED"] = str(seed)
    return seed


def pytest_report_header(config: pytest.Config) -> str:
    seed = session_seed()
    return f"polyhal: random samples from POLYHAL_SEED={seed} (set it to reproduce this run)"


def selected_devices(config: pytest.Config) -> list[str]:
    """Names of the devices the conformance suite runs on, from discovery and the options."""
    # Deferred here and below: this plugin is loaded into every pytest session of the environment
    # (a pytest11 entry point), which should not pay for importing polyhal and its plugins.
    import polyhal

    backends = config.getoption("polyhal_backend")
    names = config.getoption("polyhal_device")
    specs = polyhal.devices()
    known = {s.name for s in specs}
    for n in names:
        if n not in known:
            raise pytest.UsageError(f"--polyhal-device={n}: unknown device; discovered: {sorted(known)}")
    return [s.name for s in specs
            if (not backends or s.backend in backends) and (not names or s.name in names)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device_name" in metafunc.fixturenames:
        names = selected_devices(metafunc.config)
        if not names:
            pytest.fail("polyhal discovered no device to test; run `polyhal devices` to see why", pytrace=False)
        metafunc.parametrize("device_name", names, ids=names)


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch):
    """``make(**env)``: set environment variables, make a new default registry (so entry points
    are discovered again under that environment) and restore the previous one afterwards."""
    from polyhal.registry import Registry, set_default_registry

    made = []

    def make(**env: str) -> "Registry":
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        reg = Registry()
        made.append(set_default_registry(reg))
        return reg

    yield make
    if made:
        set_default_registry(made[0])
