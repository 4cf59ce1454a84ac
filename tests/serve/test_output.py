"""serve/output.py on the host alone: what the programs made (an `Emitted`, built here by
hand) becomes each request's deltas, in order, ended as the device or a stop string says;
samples the host ends are named for the device to stop; a preempted sample comes back as a
continuation of itself; a failing callback or request ends alone."""

import numpy as np
import pytest

from kvjax.decode.loop import StopReason
from serve import slots
from serve.output import Outputs, Ticket
from serve.requests import GenerationRequest

NO = slots.NO_SAMPLE
RUN, EOS, MAX, FULL, PRE = (StopReason.RUNNING, StopReason.EOS, StopReason.MAX_NEW_TOKENS,
                            StopReason.CACHE_FULL, StopReason.PREEMPTED)


def emitted(owner, tokens, reason, made=None, top=2):
    """An `Emitted` of B rows and O steps from [B, O] lists; each token's logprob is
    -token / 100 and its top pairs are (token + k, -k) for k < `top`, so that a delta's numbers
    name the step they came from."""
    owner, tokens = np.asarray(owner, np.int32), np.asarray(tokens, np.int32)
    made = owner != NO if made is None else np.asarray(made, bool)
    k = np.arange(top)
    return slots.Emitted(
        tokens=tokens, owner=owner, made=made, reason=np.asarray(reason, np.int32),
        logprobs=-tokens / 100.0, top_ids=tokens[..., None] + k,
        top_logprobs=np.broadcast_to(-k.astype(np.float32), tokens.shape + (top,)),
        live=np.int32(0), waiting=np.zeros(0, bool))


def ticket(prompt=(1, 2), n=1, heard=None, **settings):
    heard = [] if heard is None else heard
    return Ticket(GenerationRequest(tuple(prompt), n=n, **settings), heard.append), heard


def by_sample(heard):
    """index -> (every token id, every logprob, each delta's finish reason)."""
    out = {}
    for delta in heard:
        ids, logprobs, finishes = out.setdefault(delta.index, ([], [], []))
        ids += delta.token_ids
        logprobs += delta.logprobs
        finishes.append(delta.finish_reason)
    return out


def test_each_sample_gets_the_tokens_its_rows_made_in_order_and_ends_as_the_device_says():
    outputs = Outputs()
    a, heard_a = ticket(n=2)
    b, heard_b = ticket()
    outputs.add(a, 0, 10)
    outputs.add(a, 1, 11)
    outputs.add(b, 0, 12)
    # Row 0 serves a's first sample until its stop id, then b's; row 1 a's second sample
    # until its slot is full (the step at capacity makes nothing).
    outputs.hand_out(emitted(owner=[[10, 10, 10, 12], [11, 11, 11, NO]],
                             tokens=[[5, 6, 7, 20], [8, 9, 0, 0]],
                             reason=[[RUN, RUN, EOS, RUN], [RUN, RUN, FULL, RUN]],
                             made=[[1, 1, 1, 1], [1, 1, 0, 0]]))
    assert set(outputs.samples) == {12} and a.unfinished == 0 and b.unfinished == 1
    outputs.hand_out(emitted(owner=[[12, 12, NO, NO], [NO] * 4], tokens=[[21, 22, 0, 0], [0] * 4],
                             reason=[[RUN, MAX, RUN, RUN], [RUN] * 4]))
    assert by_sample(heard_a) == {0: ([5, 6, 7], [-0.05, -0.06, -0.07], ["stop"]),
                                  1: ([8, 9], [-0.08, -0.09], ["length"])}
    assert by_sample(heard_b) == {0: ([20, 21, 22], [-0.2, -0.21, -0.22], [None, "length"])}
    assert outputs.samples == {} and b.unfinished == 0 and outputs.to_stop == []


def test_top_logprobs_are_the_requested_count_of_each_steps_pairs():
    outputs = Outputs()
    some, heard_some = ticket(logprobs=2)
    none, heard_none = ticket()
    outputs.add(some, 0, 1)
    outputs.add(none, 0, 2)
    outputs.hand_out(emitted(owner=[[1, 1], [2, 2]], tokens=[[30, 31], [40, 41]],
                             reason=[[RUN, RUN], [RUN, RUN]], top=3))
    assert heard_some[0].top_logprobs == [[(30, 0.0), (31, -1.0)], [(31, 0.0), (32, -1.0)]]
    assert heard_none[0].top_logprobs == [[], []]


class LetterTokenizer:
    """Token i + 1 is the i-th lowercase letter; token 0 ends generation."""

    stop_ids = (0,)

    @staticmethod
    def decode(ids):
        return "".join(chr(ord("a") + i - 1) for i in ids)


def letters(text):
    return [ord(c) - ord("a") + 1 for c in text]


def test_a_stop_string_ends_the_sample_on_the_host_and_names_it_for_the_device():
    outputs = Outputs(tokenizer=LetterTokenizer())
    request, heard = ticket(stop=("cd",))
    outputs.add(request, 0, 7)
    outputs.hand_out(emitted(owner=[[7] * 3], tokens=[letters("abc")], reason=[[RUN] * 3]))
    # "c" might begin the stop string: it waits.
    assert [(d.token_ids, d.text) for d in heard] == [(letters("abc"), "ab")]
    outputs.hand_out(emitted(owner=[[7] * 3], tokens=[letters("dxy")], reason=[[RUN] * 3]))
    assert [(d.token_ids, d.text, d.finish_reason) for d in heard[1:]] == [
        (letters("d"), "", "stop")]
    assert outputs.to_stop == [7] and outputs.samples == {} and request.unfinished == 0
    # What the device still makes for it before it stops is nobody's.
    outputs.hand_out(emitted(owner=[[7]], tokens=[letters("z")], reason=[[RUN]]))
    assert len(heard) == 2


def test_a_sample_the_device_ends_gets_the_rest_of_its_text():
    outputs = Outputs(tokenizer=LetterTokenizer())
    request, heard = ticket(stop=("cd",))
    outputs.add(request, 0, 3)
    outputs.hand_out(emitted(owner=[[3, 3]], tokens=[letters("bc")], reason=[[RUN, MAX]]))
    assert "".join(d.text for d in heard) == "bc" and heard[-1].finish_reason == "length"


def test_stop_ids_are_taken_in_order_and_padded():
    outputs = Outputs()
    outputs.to_stop = [4, 5, 6]
    np.testing.assert_array_equal(outputs.take_stop_ids(2), [4, 5])
    np.testing.assert_array_equal(outputs.take_stop_ids(2), [6, -2])
    np.testing.assert_array_equal(outputs.take_stop_ids(2), [-2, -2])


class CountingAutomaton:
    """A stand-in constraint: its state counts the tokens taken, times ten plus the last."""

    initial = 0

    @staticmethod
    def next_state(state, token):
        return (state // 10 + 1) * 10 + token


def test_a_preempted_sample_continues_as_itself():
    outputs = Outputs()
    request, heard = ticket(prompt=(1, 2, 3), n=2, max_tokens=9, seed=5,
                            constraint=CountingAutomaton())
    outputs.add(request, 0, 20)
    outputs.add(request, 1, 21)
    outputs.hand_out(emitted(owner=[[21, 21, 21]], tokens=[[4, 5, 6]],
                             reason=[[RUN, RUN, PRE]]))
    assert 21 not in outputs.samples and 20 in outputs.samples
    assert by_sample(heard) == {1: ([4, 5, 6], [-0.04, -0.05, -0.06], [None])}
    (again,) = outputs.take_preempted()
    assert outputs.take_preempted() == []
    assert again.request.prompt == (1, 2, 3, 4, 5, 6) and again.request.n == 1
    assert again.request.seed == 5 and again.request.max_tokens == 9
    assert again.generated == 3 and again.indices() == [1] and again.origin is request
    assert again.automaton_state() == 36  # three tokens taken, the last 6
    outputs.resume(again.sample, 30)
    outputs.hand_out(emitted(owner=[[30]], tokens=[[7]], reason=[[EOS]]))
    assert by_sample(heard)[1] == ([4, 5, 6, 7], [-0.04, -0.05, -0.06, -0.07], [None, "stop"])
    assert request.unfinished == 1  # the other sample goes on


def test_a_callback_that_raises_cancels_its_request_alone(caplog):
    outputs = Outputs()
    calls = []

    def broken(delta):
        calls.append(delta)
        raise RuntimeError("the client's bug")

    bad = Ticket(GenerationRequest((1,)), broken)
    good, heard = ticket()
    outputs.add(bad, 0, 1)
    outputs.add(good, 0, 2)
    outputs.hand_out(emitted(owner=[[1], [2]], tokens=[[5], [6]], reason=[[RUN], [RUN]]))
    assert len(calls) == 1 and bad.cancelled and "callback raised" in caplog.text
    outputs.end_cancelled()
    assert outputs.to_stop == [1] and set(outputs.samples) == {2}
    outputs.hand_out(emitted(owner=[[2]], tokens=[[7]], reason=[[EOS]]))
    assert len(calls) == 1 and by_sample(heard) == {0: ([6, 7], [-0.06, -0.07], [None, "stop"])}


def test_a_failed_request_frees_its_own_samples_and_prefix_rows_only():
    released = []
    outputs = Outputs(release=released.append)
    failing, heard_failing = ticket(n=2)
    other, heard_other = ticket()
    outputs.add(failing, 0, 1, prefix_row=0)  # row 0 is a prefix row like any other
    outputs.add(failing, 1, 2)
    outputs.add(other, 0, 3, prefix_row=5)
    error = ValueError("bad")
    outputs.fail(failing, error)
    assert heard_failing == [error] and failing.cancelled and heard_other == []
    assert sorted(outputs.to_stop) == [1, 2] and set(outputs.samples) == {3}
    assert released == [0]
    outputs.hand_out(emitted(owner=[[3]], tokens=[[9]], reason=[[EOS]]))
    assert released == [0, 5] and [d.finish_reason for d in heard_other] == ["stop"]


@pytest.mark.parametrize("reason, finish", [(EOS, "stop"), (MAX, "length"), (FULL, "length")])
def test_a_sample_ended_with_no_new_token_still_hears_its_end(reason, finish):
    outputs = Outputs()
    request, heard = ticket()
    outputs.add(request, 0, 1)
    outputs.hand_out(emitted(owner=[[1]], tokens=[[0]], reason=[[reason]], made=[[0]]))
    assert [(d.token_ids, d.finish_reason) for d in heard] == [([], finish)]
