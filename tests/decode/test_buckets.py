"""One bucketing rule for every padded shape: powers of two and the steps halfway between."""

from kvjax.decode.buckets import bucket, power_of_two, rows_bucket, smallest_sharing

STEPS = [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]


def test_a_length_is_padded_to_the_next_power_of_two_or_halfway_step():
    for n in range(1, 300):
        assert bucket(n, 300) == min([s for s in STEPS if s >= n] + [300]), n


def test_the_smallest_length_sharing_a_bucket_is_one_past_the_bucket_below():
    for n in range(1, 300):
        below = max([s for s in STEPS if s < bucket(n, 300)], default=0)
        assert smallest_sharing(n, 300) == max(below + 1, 1), n
        assert bucket(smallest_sharing(n, 300), 300) == bucket(n, 300)


def test_a_count_is_rounded_up_to_a_power_of_two_at_least_the_floor():
    for n in range(0, 70):
        for least in (1, 2, 8):
            assert power_of_two(n, least) == min(p for p in (1, 2, 4, 8, 16, 32, 64, 128)
                                                 if p >= n and p >= least), (n, least)


def test_a_batch_runs_as_a_power_of_two_up_to_16_then_as_a_length_bucket():
    rows = [1, 2, 4] + STEPS
    for n in range(1, 500):
        padded = rows_bucket(n)
        assert padded == min(r for r in rows if r >= n), n
        assert n <= 16 or padded - n < padded / 3, n  # a third of the rows at most
