"""The training benchmark's table: MFU as printed is the row's FLOPs over its time and the peak."""

import pytest

from kvjax.benchmarks.train import TrainRow, format_train_table


def printed_mfu(table: str) -> list[float]:
    return [float(line.split("|")[4].strip(" %")) for line in table.splitlines()
            if line.startswith("| kvjax")]


@pytest.mark.parametrize("flops_per_step", [3.71e12, 2.1e9, 4.2e6])
def test_the_printed_mfu_is_the_rows_flops_over_time_and_peak_never_rounded_to_zero(
        flops_per_step):
    # A tiny model on a fast GPU uses a millionth of the peak: printed as 0.0% it would hide
    # the figure the row exists to give.
    row = TrainRow("kvjax, scanned layers", step_seconds=0.01, tokens_per_step=1024,
                   flops_per_step=flops_per_step)
    peak = 1e15
    (printed,) = printed_mfu(format_train_table([row], "setting", peak))
    expected = 100 * flops_per_step / 0.01 / peak
    assert printed > 0
    assert printed == pytest.approx(expected, rel=0.05 if expected >= 1 else 0.03)
