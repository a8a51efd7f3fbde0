"""The core's conformance suite on HIP devices.

Two ways:

* on real AMD GPUs (``--polyhal-backend=hip`` on a machine with one): every test, parametrized
  by the core's pytest plugin (without a GPU this module's hardware part skips, saying why);
* here, on ``hip:0`` over FakeHipRuntime (a stand-in, not ROCm): the suite's hardware-free
  tests -- allocator contract, accounting, copies, mapping, DLPack round trips of every heap --
  and plan compilation up to launch (kernels compiled for real with hiprtc, never executed).
  The tests that check kernel results need a GPU and are not run on the stand-in.
"""

import pytest

from polyhal.testing import conformance as suite

HARDWARE_FREE = [
    "test_allocate_map_free_every_heap", "test_optimal_and_accounting", "test_write_read_roundtrip",
    "test_zero_d_and_empty_tensors_keep_their_shape",
    "test_bad_sizes_are_refused", "test_unservable_requests_are_refused", "test_mapping_device_only_memory_is_refused",
    "test_dlpack_roundtrip_every_heap", "test_dlpack_capsule_consumed_twice",
    "test_declared_kernel_names_are_the_kernels_it_serves", "test_queues_order_copies_and_signal",
]
#: Hardware-free, but compiles a kernel (hiprtc must be installed).
COMPILES = ["test_plan_input_errors"]
NEEDS_HARDWARE = ["test_kernel_matches_reference", "test_kernel_special_values", "test_kernel_empty_tensors",
                  "test_plan_runs_repeatedly_and_balances", "test_storage_type_casts", "test_storage_casts_at_the_edges"]


@pytest.fixture
def device(fake_device):
    """hip:0 over FakeHipRuntime (a stand-in, not ROCm): the suite's ``device`` fixture here."""
    return fake_device


# The suite's tests, bound to the stand-in device above (no ``device_name`` parameter, so the
# core plugin does not parametrize them over the discovered devices).
for _name in HARDWARE_FREE:
    globals()[f"{_name}_on_fake_hip"] = getattr(suite, _name)


def test_plan_input_errors_on_fake_hip(device, needs_compiler):
    suite.test_plan_input_errors(device)


def test_suite_is_covered():
    """Every test of the suite is either run on the stand-in or listed as needing hardware."""
    names = {n for n in dir(suite) if n.startswith("test_")}
    covered = set(HARDWARE_FREE) | set(COMPILES) | set(NEEDS_HARDWARE)
    assert names == covered, sorted(names ^ covered)
