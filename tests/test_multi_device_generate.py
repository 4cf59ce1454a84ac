"""Runs `tests/multidevice/check_generate.py` on 8 emulated CPU devices, from a module of its
own so that it can run beside the other multi-device files (see test_multi_device.py)."""

from test_multi_device import ON_THEIR_OWN, check_on_eight_devices


def test_generate_on_eight_devices(tmp_path):
    assert ON_THEIR_OWN == ("check_generate.py",)
    check_on_eight_devices("check_generate.py", tmp_path)
