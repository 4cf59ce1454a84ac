"""Constrained rows in the compiled loop: greedy equals the argmax over the allowed tokens of
the model's uncached logits, walked through the same automaton in Python; an unconstrained
row beside them is untouched; every sampled output that ends is valid JSON for its schema
(checked by `jsonschema`); another schema of the same table sizes compiles nothing."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from conftest import drain, run_cli, run_full

from kvjax import decode, text

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "python-docs-lm"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "kind": {"enum": ["list", "dict", "set", None]},
    "sizes": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "kind", "sizes"]}
NESTED = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "[a-f0-9]{4}"},
    "where": {"type": "object", "properties": {
        "line": {"type": "integer"}, "file": {"type": "string", "maxLength": 8}},
        "required": ["line"]},
    "score": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
    "required": ["id", "where"]}
LISTS = {"type": "array", "items": {"$ref": "#/$defs/pair"}, "maxItems": 2,
         "$defs": {"pair": {"type": "array", "prefixItems": [{"type": "boolean"},
                                                             {"const": "x"}]}}}


@pytest.fixture(scope="module")
def lm():
    return text.load(CHECKPOINT)


def prompt(lm, words):
    return list(lm.tokenizer.document_prefix) + lm.tokenizer.encode(words)


def reference_greedy(lm, prompt_ids, automaton, steps):
    """The textbook loop, constrained: the whole sequence recomputed without a cache, the
    logits of tokens the automaton's state does not allow set to -inf, the argmax taken."""
    config, width = lm.net.config, 128
    sequence, state, generated = list(prompt_ids), automaton.initial, []
    for _ in range(steps):
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(sequence)] = sequence
        logits = np.asarray(run_full(config, lm.params, jnp.asarray(padded)))[0, len(sequence) - 1]
        masked = np.full_like(logits, -np.inf)
        allowed = automaton.allowed(state)
        masked[allowed] = logits[allowed]
        token = int(np.argmax(masked))
        generated.append(token)
        if token == automaton.end_id:
            break
        state = automaton.next_state(state, token)
        sequence.append(token)
    return generated


def greedy_rows(lm, constraints):
    """(prompts, greedy rows) of three prompts, each under its one of `constraints`."""
    prompts = [prompt(lm, "The for statement"), prompt(lm, "A loop"),
               prompt(lm, "The list type")]
    out = decode.generate(lm.net, lm.params, prompts, max_new_tokens=40,
                          eos_ids=lm.tokenizer.stop_ids, constraint=constraints)
    return prompts, out.token_lists()


def test_greedy_equals_the_argmax_over_allowed_tokens_and_other_rows_are_untouched(lm):
    tok = lm.tokenizer
    person = decode.compile_constraint(decode.JsonSchema(PERSON), tok)
    choice = decode.compile_constraint(decode.Choice(["for", "for each", "while"]), tok)
    prompts, rows = greedy_rows(lm, [person, choice, None])
    alone = decode.generate(lm.net, lm.params, prompts[2:], max_new_tokens=40,
                            eos_ids=tok.stop_ids)
    assert rows[0] == reference_greedy(lm, prompts[0], person, 40)
    assert rows[1] == reference_greedy(lm, prompts[1], choice, 40)
    assert tok.decode(rows[1]) in ("for", "for each", "while")
    assert rows[2] == alone.token_lists()[0]


def test_allowed_tokens_hold_every_step_to_their_ids_the_end_only_if_listed(lm):
    tok = lm.tokenizer
    ids = sorted(set(tok.encode("for each loop in a list")))
    allowed = decode.compile_constraint(decode.AllowedTokens(ids), tok)
    choice = decode.compile_constraint(decode.Choice(["for", "for each", "while"]), tok)
    prompts, rows = greedy_rows(lm, [allowed, choice, None])
    assert rows[0] == reference_greedy(lm, prompts[0], allowed, 40)
    assert len(rows[0]) == 40 and set(rows[0]) <= set(ids)  # no end id among them


@pytest.mark.parametrize("schema", [PERSON, NESTED, LISTS], ids=["flat", "nested", "refs"])
def test_every_sampled_output_that_ends_is_valid_json_for_its_schema(lm, schema):
    tok = lm.tokenizer
    automaton = decode.compile_constraint(decode.JsonSchema(schema), tok)
    prompts = [prompt(lm, words) for words in ("The", "import json", "def f(x):", "Return")]
    ended = 0
    for seed in range(3):
        out = decode.generate(lm.net, lm.params, prompts, max_new_tokens=96,
                              eos_ids=tok.stop_ids, constraint=automaton, num_samples=2,
                              sampling=decode.Sampling(temperature=1.0),
                              rng=jax.random.key(seed))
        for row, reason in zip(out.token_lists(), out.stop_reasons(), strict=True):
            if reason == "eos":
                jsonschema.validate(json.loads(tok.decode(row)), schema)
                ended += 1
    assert ended >= 20  # of 24: a sample may run out of tokens inside a long number


def test_sampling_filters_stream_and_samples_keep_to_the_constraint(lm):
    tok = lm.tokenizer
    automaton = decode.compile_constraint(decode.Regex("(yes|no|maybe), [0-9]{2}"), tok)
    prompts = [prompt(lm, "Is it"), prompt(lm, "Answer")]
    kwargs = dict(max_new_tokens=12, eos_ids=tok.stop_ids, constraint=automaton,
                  num_samples=3, rng=jax.random.key(7),
                  sampling=decode.Sampling(temperature=1.3, top_k=(5, 0), top_p=(1.0, 0.8),
                                           repetition_penalty=1.2))
    out = decode.generate(lm.net, lm.params, prompts, **kwargs)
    chunks, streamed = drain(decode.stream(lm.net, lm.params, prompts, chunk_size=3,
                                           **kwargs))
    joined = np.concatenate(chunks, axis=1)  # it ends when every row has
    np.testing.assert_array_equal(joined, out.tokens[:, :joined.shape[1]])
    np.testing.assert_array_equal(streamed.tokens, out.tokens)
    for row in out.token_lists():
        words, number = tok.decode(row).split(", ")
        assert words in ("yes", "no", "maybe") and len(number) == 2 and number.isdigit()
    assert out.stop_reasons() == ["eos"] * 6


def test_another_schema_of_the_same_table_sizes_compiles_nothing(lm):
    tok = lm.tokenizer
    prompts = [prompt(lm, "x = ")]
    first = decode.compile_constraint(decode.Regex("[0-9]{3}"), tok)
    second = decode.compile_constraint(decode.Regex("[0-9]{2}"), tok)
    assert first.num_states != second.num_states and first.tokens.size != second.tokens.size
    decode.generate(lm.net, lm.params, prompts, max_new_tokens=8, eos_ids=tok.stop_ids,
                    constraint=first)
    before = decode.trace_count("start"), decode.trace_count("continue")
    out = decode.generate(lm.net, lm.params, prompts, max_new_tokens=8, eos_ids=tok.stop_ids,
                          constraint=second)
    assert (decode.trace_count("start"), decode.trace_count("continue")) == before
    assert tok.decode(out.token_lists()[0]).isdigit()


def test_a_kept_prompt_continues_under_a_constraint(lm):
    tok = lm.tokenizer
    automaton = decode.compile_constraint(decode.Choice(["True", "False"]), tok)
    words = prompt(lm, "The value is")
    state = decode.prefill(lm.net, lm.params, [words])
    kept = decode.generate(lm.net, lm.params, None, state=state, max_new_tokens=6,
                           eos_ids=tok.stop_ids, constraint=automaton)
    fresh = decode.generate(lm.net, lm.params, [words], max_new_tokens=6,
                            eos_ids=tok.stop_ids, constraint=automaton)
    assert kept.token_lists() == fresh.token_lists()
    assert tok.decode(kept.token_lists()[0]) in ("True", "False")


def test_misused_constraints_are_named(lm):
    tok = lm.tokenizer
    automaton = decode.compile_constraint(decode.Regex("a+"), tok)
    prompts = [prompt(lm, "a")]
    cases = [
        (dict(eos_ids=()), "not among eos_ids"),
        (dict(eos_ids=tok.stop_ids, constraint=[automaton, None]), "2 entries for 1 prompts"),
        (dict(eos_ids=tok.stop_ids, constraint=["a+"]), "must be a TokenAutomaton"),
        (dict(eos_ids=tok.stop_ids, sampling=decode.Sampling(min_tokens=2)),
         "min_tokens=2 would hold back the end id a constraint needs"),
    ]
    for kwargs, message in cases:
        kwargs = {"constraint": automaton, **kwargs}
        with pytest.raises(ValueError, match=message):
            decode.generate(lm.net, lm.params, prompts, max_new_tokens=4, **kwargs)


def test_sample_text_and_the_command_line_keep_to_a_constraint(lm, capsys, tmp_path):
    schema = {"type": "object", "properties": {"kind": {"enum": ["list", "dict"]},
                                               "ok": {"type": "boolean"}},
              "required": ["kind", "ok"]}
    result = text.sample_text(lm, "The for statement", max_new_tokens=60,
                              constraint=decode.JsonSchema(schema))
    assert result.stop_reason == "eos"
    jsonschema.validate(json.loads(result.text), schema)
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    code, out, _ = run_cli(capsys, "sample", "--checkpoint", CHECKPOINT, "--prompt", "The for "
                           "statement", "--max-new-tokens", 60, "--json-schema", schema_file)
    assert code == 0 and out.splitlines()[0] == "The for statement" + result.text
    numbers = CHECKPOINT.parent / "numbers-to-words"
    code, out, _ = run_cli(capsys, "sample", "--checkpoint", numbers, "--prompt", "4021",
                           "--choice", "four thousand twenty-one", "--choice", "nine")
    assert code == 0 and out.splitlines()[0] in ("4021 -> four thousand twenty-one",
                                                 "4021 -> nine")
    code, out, err = run_cli(capsys, "sample", "--checkpoint", CHECKPOINT, "--prompt", "x",
                             "--json-schema", '{"type": "integer", "maximum": 3}')
    assert code == 2 and out == "" and "'maximum'" in err


def all_paths(automaton, state=None, prefix=()):
    """Every token sequence a finite automaton accepts, each ending with its end id."""
    state = automaton.initial if state is None else state
    paths = []
    for token in automaton.allowed(state):
        token = int(token)
        if token == automaton.end_id:
            paths.append(prefix + (token,))
        else:
            paths += all_paths(automaton, automaton.next_state(state, token), prefix + (token,))
    return paths


def test_beam_search_under_a_choice_finds_the_best_scoring_path(lm):
    tok = lm.tokenizer
    automaton = decode.compile_constraint(decode.Choice(["for", "while", "with"]), tok)
    paths = all_paths(automaton)
    words = prompt(lm, "A loop")
    width = 1 << (len(paths) - 1).bit_length()  # every path stays a beam: the search is exact

    def score(path):  # teacher-forced, as beam search sums and penalises it
        padded = np.zeros((1, 128), np.int32)
        padded[0, :len(words) + len(path)] = words + list(path)
        logits = np.asarray(run_full(lm.net.config, lm.params, jnp.asarray(padded)))[0]
        logprobs = jax.nn.log_softmax(logits[len(words) - 1:len(words) + len(path) - 1])
        return float(sum(logprobs[i, t] for i, t in enumerate(path))) / len(path) ** 0.5

    best = max(paths, key=score)
    out = decode.beam_search(lm.net, lm.params, [words], max_new_tokens=8, num_beams=width,
                             length_penalty=0.5, eos_ids=tok.stop_ids, constraint=automaton)
    assert out.token_lists()[0] == list(best)
    np.testing.assert_allclose(out.scores[0], score(best), rtol=1e-4)
    greedy = decode.generate(lm.net, lm.params, [words], max_new_tokens=8,
                             eos_ids=tok.stop_ids, constraint=automaton)
    one = decode.beam_search(lm.net, lm.params, [words], max_new_tokens=8, num_beams=1,
                             eos_ids=tok.stop_ids, constraint=automaton)
    assert one.token_lists() == greedy.token_lists()


def test_speculative_decoding_under_a_constraint_keeps_to_it(lm):
    """Greedy rows emit exactly the plain constrained loop's tokens, whatever the drafts
    (prompt lookup drafts from a prompt that repeats the JSON; the draft model, the target's
    first layer, drafts freely and has its disallowed drafts rejected); sampled rows stay
    inside the language."""
    from kvjax.decode import draft_model

    tok = lm.tokenizer
    automaton = decode.compile_constraint(decode.JsonSchema(PERSON), tok)
    words = [prompt(lm, 'x = {"name": "a", "kind": "list", "sizes": [1]} y = '),
             prompt(lm, "The list type"), prompt(lm, "import json")]
    constraint = [automaton, automaton, None]
    kwargs = dict(max_new_tokens=48, eos_ids=tok.stop_ids, constraint=constraint)
    plain = decode.generate(lm.net, lm.params, words, **kwargs)
    draft_net, draft_params = draft_model.first_layers(lm.net.config, lm.params, 1)
    for speculative in (decode.Speculative(num_draft_tokens=4, min_tokens_per_call=0),
                        decode.Speculative("draft", 3, draft_model=draft_net,
                                           draft_params=draft_params, min_tokens_per_call=0)):
        out = decode.generate(lm.net, lm.params, words, speculative=speculative, **kwargs)
        assert out.token_lists() == plain.token_lists(), speculative.method
        assert out.speculation.accepted.sum() > 0
    sampled = decode.generate(lm.net, lm.params, words[:2], max_new_tokens=96,
                              eos_ids=tok.stop_ids, constraint=automaton, num_samples=3,
                              sampling=decode.Sampling(temperature=1.0),
                              rng=jax.random.key(3),
                              speculative=decode.Speculative(num_draft_tokens=4,
                                                             min_tokens_per_call=0))
    ended = 0
    for row, reason in zip(sampled.token_lists(), sampled.stop_reasons(), strict=True):
        if reason == "eos":
            jsonschema.validate(json.loads(tok.decode(row)), PERSON)
            ended += 1
    assert ended >= 4  # of 6
