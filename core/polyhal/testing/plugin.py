"""pytest plugin of the conformance suite: options and per-device parametrization.

Kept import-light (polyhal is imported only when a test asks for a device), because pytest
loads it in every session once polyhal is installed.

A backend author runs the suite on their devices with::

    pytest --pyargs polyhal.testing.conformance --polyhal-backend=mydev

It also gives every test session the ``fresh_registry`` fixture, for plugin tests that need the
registry rebuilt under a given environment, and ``polyhal_seed``, the base seed of random samples.

It stays silent in sessions that do not use it: the seed line is printed only where a polyhal
option is given (in the header) or a collected test requests one of its fixtures (after
collection), and nothing is written to ``os.environ``.
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


#: The fixtures this plugin gives; a session whose tests request none of them hears nothing from it.
FIXTURES = frozenset({"device_name", "fresh_registry", "polyhal_seed"})
#: The seed drawn for this process where POLYHAL_SEED is unset (kept here, not in os.environ:
#: the environment of an unrelated session, and of the processes it starts, stays its own).
_drawn: int | None = None


def session_seed() -> int:
    """The base seed of this session's random samples: ``POLYHAL_SEED`` if set, else drawn once
    per process (shown after collection; a test that starts a child passes it on itself)."""
    global _drawn
    from polyhal.testing.settings import TestSettings

    seed = TestSettings.from_env().seed
    if seed is not None:
        return seed
    if _drawn is None:
        _drawn = int.from_bytes(os.urandom(4), "little")
    return _drawn


def _seed_line() -> str:
    return f"polyhal: random samples from POLYHAL_SEED={session_seed()} (set it to reproduce this run)"


def _options_given(config: pytest.Config) -> bool:
    return bool(config.getoption("polyhal_backend") or config.getoption("polyhal_device"))


def pytest_report_header(config: pytest.Config) -> str | None:
    return _seed_line() if _options_given(config) else None


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> str | None:
    if _options_given(config):
        return None  # said in the header
    uses = any(FIXTURES & set(getattr(item, "fixturenames", ())) for item in items)
    return _seed_line() if uses else None


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
def polyhal_seed() -> int:
    """The session's base seed of random samples (:func:`session_seed`): ``POLYHAL_SEED`` if set,
    else drawn once and shown after collection, so that a failure can be reproduced."""
    return session_seed()


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
