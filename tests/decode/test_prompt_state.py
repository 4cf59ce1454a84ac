"""Reusing a prefilled prompt: a continuation equals generating from the concatenated
prompt (exact tokens, close logprobs), a kept state serves many continuations, a chat's
turns append to one cache, and a state is refused with another model or params."""

import jax
import numpy as np
import pytest

from kvjax import decode
from kvjax import model as M

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15]]
NEW = [[30, 31], [40, 41, 42, 43, 44]]
def test_continuing_with_new_tokens_equals_the_concatenated_prompt(tiny_lm):
    _, net, params = tiny_lm
    state = decode.prefill(net, params, PROMPTS, capacity=48)
    continued = decode.generate(net, params, NEW, state=state, max_new_tokens=8,
                                return_logprobs=True)
    whole = decode.generate(net, params, [p + n for p, n in zip(PROMPTS, NEW, strict=True)],
                            max_new_tokens=8, return_logprobs=True)
    np.testing.assert_array_equal(continued.tokens, whole.tokens)
    np.testing.assert_allclose(continued.logprobs, whole.logprobs, atol=1e-4)


def test_one_state_serves_many_continuations(tiny_lm):
    _, net, params = tiny_lm
    state = decode.prefill(net, params, PROMPTS)
    before = decode.trace_count("prefill")
    kwargs = dict(max_new_tokens=6, sampling=decode.Sampling(temperature=1.0),
                  rng=jax.random.key(3))
    fresh = decode.generate(net, params, PROMPTS, **kwargs)
    for _ in range(2):  # the state is still whole after the first continuation
        from_state = decode.generate(net, params, state=state, **kwargs)
        np.testing.assert_array_equal(from_state.tokens, fresh.tokens)
    assert decode.trace_count("prefill") == before
    samples = decode.generate(net, params, state=state, max_new_tokens=6, num_samples=2,
                              sampling=decode.Sampling(temperature=1.0),
                              rng=jax.random.key(3))
    assert samples.tokens.shape == (4, 6)


def test_chat_turns_append_to_one_cache(tiny):
    """Turn 1 from the prompt, turn 2 after appending new tokens to turn 1's output, both
    from kept states, equal generating turn 2 from the whole conversation at once. Row 0
    stops early at an eos id, so its cache must be cut back to what it really holds."""
    config, net, params = tiny
    prompts = [[40, 41], PROMPTS[1]]  # rows that this random model continues differently
    state = decode.prefill(net, params, prompts, capacity=64)
    first = decode.generate(net, params, state=state, max_new_tokens=6)
    eos = next(int(t) for t in first.tokens[0, :3] if t not in first.tokens[1])
    turn1 = decode.generate(net, params, state=state, max_new_tokens=6, eos_ids=(eos,),
                            return_state=True)
    assert turn1.lengths[0] <= 3 and turn1.lengths[1] == 6
    turn2 = decode.generate(net, params, NEW, state=turn1.state, max_new_tokens=5,
                            return_logprobs=True)
    history = turn1.token_lists()
    if config.is_encoder_decoder:  # the conversation is the target: feed it after BOS
        state = decode.prefill(net, params, prompts, capacity=64)
        forced = [h + n for h, n in zip(history, NEW, strict=True)]
        expected = decode.generate(net, params, forced, state=state, max_new_tokens=5,
                                   return_logprobs=True)
    else:
        expected = decode.generate(net, params, [p + h + n for p, h, n in zip(
            prompts, history, NEW, strict=True)], max_new_tokens=5, return_logprobs=True)
    np.testing.assert_allclose(turn2.logprobs, expected.logprobs, atol=1e-4)
    np.testing.assert_array_equal(turn2.tokens, expected.tokens)


def test_continuing_without_new_tokens_equals_one_longer_generation(tiny_lm):
    # The encoder-decoder continues a returned state in the chat test above.
    _, net, params = tiny_lm
    whole = decode.generate(net, params, PROMPTS, max_new_tokens=9)
    part = decode.generate(net, params, PROMPTS, max_new_tokens=4, return_state=True)
    rest = decode.generate(net, params, state=part.state, max_new_tokens=5)
    np.testing.assert_array_equal(np.concatenate([part.tokens, rest.tokens], axis=1),
                                  whole.tokens)


def test_continuations_compile_once_per_bucket(tiny_lm):
    _, net, params = tiny_lm
    state = decode.prefill(net, params, PROMPTS, capacity=64)
    rng = np.random.default_rng(0)
    counts = None
    for i in range(20):
        new = [rng.integers(0, 64, size=rng.integers(1, 9)).tolist() for _ in PROMPTS]
        decode.generate(net, params, new, state=state, max_new_tokens=int(rng.integers(9, 17)),
                        sampling=decode.Sampling(
                            temperature=[float(rng.uniform(0, 2)), 0.0], top_p=0.9,
                            min_p=float(rng.uniform(0, 0.3)), repetition_penalty=[1.0, 1.3],
                            no_repeat_ngram_size=int(i % 3)),
                        rng=jax.random.key(i),
                        return_state=bool(i % 2))
        now = [decode.trace_count(n) for n in ("resume", "continue", "keep")]
        if i == 1:
            counts = now
    assert now == counts


def _refuses(net, params, state, match, new=None, **kwargs):
    counts = [decode.trace_count(n) for n in ("resume", "continue", "start")]
    with pytest.raises(ValueError, match=match):
        decode.generate(net, params, new, state=state, **{"max_new_tokens": 4, **kwargs})
    assert counts == [decode.trace_count(n) for n in ("resume", "continue", "start")]


def test_a_state_is_refused_with_another_model_params_or_too_little_room(tiny_lm):
    config, net, params = tiny_lm
    state = decode.prefill(net, params, PROMPTS, capacity=16)
    copied = jax.tree.map(lambda x: x + 0, params)
    _refuses(net, copied, state, "params are not the ones the state was made with")
    other = M.preset("tiny", positional_encoding="rope", num_kv_heads=1)
    _refuses(M.build_model(other), M.init_params(other, jax.random.key(0)), state,
             "state was made with another model")
    _refuses(net, params, state, "3 rows of new tokens for a state of 2 rows",
             new=[[1], [2], [3]])
    _refuses(net, params, state, r"row 1 holds 7 tokens; with 3 new tokens .* needs 17 cache "
             r"slots, more than the state's capacity 16", new=[[1], [2, 3, 4]], max_new_tokens=8)
    _refuses(net, params, state, "temperature has 3 values",
             sampling=decode.Sampling(temperature=[1, 1, 1]))
    _refuses(net, params, "not a state", "state must be a PromptState")
