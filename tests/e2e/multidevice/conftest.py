"""Run by `tests/e2e/test_multi_device.py` with 8 emulated devices; refuses to run with fewer."""

import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    if jax.device_count() != 8:
        pytest.fail(f"these tests need 8 devices, JAX has {jax.device_count()}: run them "
                    "through tests/e2e/test_multi_device.py")
