"""Runs the files of `tests/e2e/multidevice/` that test_multi_device.py leaves to a module of
their own (`ON_THEIR_OWN`) on 8 emulated CPU devices, so that they can run beside the others.
A file missing there fails here: its pytest process finds nothing to run."""

import pytest
from test_multi_device import ON_THEIR_OWN, check_on_eight_devices


@pytest.mark.parametrize("name", ON_THEIR_OWN)
def test_on_eight_devices_on_its_own(name, tmp_path):
    check_on_eight_devices(name, tmp_path)
