"""`kvjax bench speculative`: its rows measure speculative decoding that gives plain greedy's
tokens, and its table says so."""

from kvjax.benchmarks.speculative import format_table, speculative_benchmark


def test_rows_compare_equal_tokens_on_both_tasks():
    # The copying task's prompts repeat 8 of their tokens: 33 and 41 tokens share one length
    # bucket, so both tasks run the same programs.
    rows = speculative_benchmark(preset="tiny", batch_sizes=(2,), prompt_len=33, new_tokens=16,
                                 repeats=1)
    assert [(r.task, r.batch) for r in rows] == [("copying", 2), ("fresh", 2)]
    assert all(r.same_tokens and r.plain_tokens_per_s > 0 and r.speculative_tokens_per_s > 0
               and 0 <= r.acceptance <= 1 and r.tokens_per_step >= 1 for r in rows)
    table = format_table(rows, num_draft_tokens=4, ngram_size=2)
    assert "prompt lookup (n=2)" in table and table.count("| yes |") == 2
