"""Chat templates of imported models: `kvjax.serve.chat.render` against transformers'
`apply_chat_template`, on a tiny Hugging Face tokenizer directory (tests/fixtures) given a
ChatML-style template that uses what transformers' environment provides."""

import json
import shutil
from pathlib import Path

import pytest
from conftest import FakeTokenizer

from kvjax.serve import chat
from kvjax.tokenizer.huggingface import from_bundle, load_tokenizer

pytest.importorskip("tokenizers")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf_tokenizers" / "byte_bpe"

TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'tool' %}"
    "{{ raise_exception('no tool messages here, got ' + (message['content'] | tojson)) }}"
    "{% endif %}\n"
    "{%- if loop.first and message['role'] != 'system' %}\n"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "{% endif %}\n"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}"
    "{{ eos_token }}{% endgeneration %}{% else %}{{ message['content'] | trim }}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}\n"
    "{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "  Grüße! What is a KV cache? "},
            {"role": "assistant", "content": "Keys and values."},
            {"role": "user", "content": [{"type": "text", "text": "Why "},
                                         {"type": "text", "text": "keep them?"}]}]
# The same messages with their content as strings, as transformers takes them (text parts
# joined by newlines, as vLLM joins them).
PLAIN_MESSAGES = MESSAGES[:2] + [{"role": "user", "content": "Why \nkeep them?"}]
# What transformers 5.25's apply_chat_template(PLAIN_MESSAGES, add_generation_prompt=True,
# tokenize=False) renders (byte_bpe: GPT2Tokenizer, bos and eos <|endoftext|>).
EXPECTED = ("<|endoftext|><|im_start|>system\nYou are helpful.<|im_end|>\n"
            "<|im_start|>user\nGrüße! What is a KV cache?<|im_end|>\n"
            "<|im_start|>assistant\nKeys and values.<|endoftext|><|im_end|>\n"
            "<|im_start|>user\nWhy \nkeep them?<|im_end|>\n"
            "<|im_start|>assistant\n")

# The same rendered with add_generation_prompt=False; and PLAIN_MESSAGES[:2] (its final message
# the assistant's, given once as it is and once with trailing spaces, which the template
# trims) with continue_final_message=True.
WITHOUT_GENERATION_PROMPT = EXPECTED.removesuffix("<|im_start|>assistant\n")
CONTINUED = ("<|endoftext|><|im_start|>system\nYou are helpful.<|im_end|>\n"
             "<|im_start|>user\nGrüße! What is a KV cache?<|im_end|>\n"
             "<|im_start|>assistant\nKeys and values.")
BEGUN = [PLAIN_MESSAGES[0], {"role": "assistant", "content": "Keys and  "}]
CONTINUED_TRIMMED = CONTINUED.removesuffix(" values.")


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    """byte_bpe with the template in tokenizer_config.json."""
    out = tmp_path_factory.mktemp("chat") / "byte_bpe"
    shutil.copytree(FIXTURE, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config,
                                                           "chat_template": TEMPLATE}))
    return out


def test_the_template_renders_as_transformers_renders_it(directory):
    tokenizer = load_tokenizer(directory)
    assert tokenizer.chat_template == TEMPLATE
    text, templated = chat.render(tokenizer, MESSAGES)
    assert templated and text == EXPECTED
    # The special tokens in the text are read as their ids, once each.
    ids = tokenizer.encode(text)
    assert ids.count(tokenizer.encode("<|im_start|>")[0]) == 5
    assert ids.count(tokenizer.eos_id) == 2
    # An import-hf checkpoint keeps the tokenizer as a bundle: the template travels with it.
    assert chat.render(from_bundle(tokenizer.to_bytes()), MESSAGES) == (EXPECTED, True)


def test_a_text_ends_without_an_answers_start_or_inside_the_final_message(directory):
    """`add_generation_prompt` false leaves the assistant's header out; with
    `continue_final_message` the text stops right after the final message's content (less
    what the template trims of it), as transformers stops it, for the model to go on."""
    tokenizer = load_tokenizer(directory)
    assert chat.render(tokenizer, MESSAGES, add_generation_prompt=False) == (
        WITHOUT_GENERATION_PROMPT, True)
    for messages, expected in ((MESSAGES[:2], CONTINUED), (BEGUN, CONTINUED_TRIMMED)):
        assert chat.render(tokenizer, messages, add_generation_prompt=False,
                           continue_final_message=True) == (expected, True)
    plain = [("user", "Hi"), ("assistant", "Keys ")]
    assert chat.render(object(), [dict(zip(("role", "content"), m, strict=True))
                                  for m in plain], add_generation_prompt=False,
                       continue_final_message=True) == ("user: Hi\nassistant: Keys ", False)
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message"):
        chat.render(tokenizer, MESSAGES, continue_final_message=True)

    class Dropping:
        chat_template = "{% for m in messages %}{{ m['role'] }}|{% endfor %}"

    with pytest.raises(ValueError, match="leaves out the final message's content"):
        chat.render(Dropping(), MESSAGES, add_generation_prompt=False,
                    continue_final_message=True)


def test_transformers_renders_the_same_text_and_ids(directory):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    assert theirs.apply_chat_template(PLAIN_MESSAGES, add_generation_prompt=True,
                                      tokenize=False) == EXPECTED
    assert theirs.apply_chat_template(PLAIN_MESSAGES, add_generation_prompt=False,
                                      tokenize=False) == WITHOUT_GENERATION_PROMPT
    for messages, expected in ((PLAIN_MESSAGES[:2], CONTINUED), (BEGUN, CONTINUED_TRIMMED)):
        assert theirs.apply_chat_template(messages, continue_final_message=True,
                                          tokenize=False) == expected
    ours = load_tokenizer(directory)
    their_ids = theirs.apply_chat_template(PLAIN_MESSAGES, add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    assert ours.encode(chat.render(ours, MESSAGES)[0]) == list(their_ids)


def test_chat_template_jinja_wins_and_a_list_names_its_default(directory, tmp_path):
    both = tmp_path / "both"
    shutil.copytree(directory, both)
    (both / "chat_template.jinja").write_text("{{ messages[0]['content'] }}|{{ eos_token }}")
    assert chat.render(load_tokenizer(both), MESSAGES[:1])[0] == (
        "  Grüße! What is a KV cache? |<|endoftext|>")
    listed = tmp_path / "listed"
    shutil.copytree(directory, listed)
    config = json.loads((listed / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "tools"},
                               {"name": "default", "template": "default {{ bos_token }}"}]
    (listed / "tokenizer_config.json").write_text(json.dumps(config))
    assert chat.render(load_tokenizer(listed), MESSAGES[:1]) == (
        "default <|endoftext|>", True)


def test_a_template_that_refuses_or_escapes_is_a_value_error(directory):
    tokenizer = load_tokenizer(directory)
    with pytest.raises(ValueError, match='refused these messages: no tool messages here, '
                                         'got "ü"'):
        chat.render(tokenizer, [{"role": "tool", "content": "ü"}])

    class Escaping:
        chat_template = "{{ messages.__class__.__mro__ }}"

    with pytest.raises(ValueError, match="refused these messages: access to attribute"):
        chat.render(Escaping(), MESSAGES)

    class Broken:
        chat_template = "{% for m in messages %}"

    with pytest.raises(ValueError, match="chat template does not parse"):
        chat.render(Broken(), MESSAGES)


# Gemma 3's template (tests/fixtures/chat_templates/gemma3.jinja, in the gemma3_text fixture):
# a system message joins the first user turn, the assistant is "model", roles must alternate.
GEMMA = Path(__file__).resolve().parents[1] / "fixtures" / "hf_models" / "gemma3_text"
GEMMA_MESSAGES = [{"role": "system", "content": "Answer briefly."}, *PLAIN_MESSAGES]
# What transformers 5.25's apply_chat_template(GEMMA_MESSAGES, add_generation_prompt=True,
# tokenize=False) renders (spm_bpe: bos <s>).
GEMMA_EXPECTED = ("<s><start_of_turn>user\nAnswer briefly.\n\nGrüße! What is a KV cache?"
                  "<end_of_turn>\n<start_of_turn>model\nKeys and values.<end_of_turn>\n"
                  "<start_of_turn>user\nWhy \nkeep them?<end_of_turn>\n<start_of_turn>model\n")


def test_gemmas_template_renders_as_transformers_renders_it():
    tokenizer = load_tokenizer(GEMMA)
    assert chat.render(tokenizer, GEMMA_MESSAGES) == (GEMMA_EXPECTED, True)
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        chat.render(tokenizer, PLAIN_MESSAGES[:1] * 2)
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(GEMMA)
    assert theirs.apply_chat_template(GEMMA_MESSAGES, add_generation_prompt=True,
                                      tokenize=False) == GEMMA_EXPECTED
    their_ids = theirs.apply_chat_template(GEMMA_MESSAGES, add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    assert tokenizer.encode(GEMMA_EXPECTED) == list(their_ids)


# A Hermes/Qwen-style tool template: the tools as JSON lines, an assistant's calls in
# <tool_call> tags, tool results as their own turns.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n{\"name\": "
    "\"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]
TOOL_MESSAGES = [{"role": "user", "content": "Weather in Zürich?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "call_1", "type": "function", "function": {
                         "name": "get_weather", "arguments": {"city": "Zürich"}}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "12 °C"}]
TOOL_EXPECTED = (
    "<|im_start|>system\n# Tools\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Wetter", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n'
    "<|im_end|>\n<|im_start|>user\nWeather in Zürich?<|im_end|>\n<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    "<|im_end|>\n<|im_start|>tool\n12 °C<|im_end|>\n<|im_start|>assistant\n")


def test_tools_and_tool_calls_render_as_transformers_renders_them(directory, tmp_path):
    tooled = tmp_path / "tooled"
    shutil.copytree(directory, tooled)
    config = json.loads((tooled / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": TEMPLATE},
                               {"name": "tool_use", "template": TOOL_TEMPLATE}]
    (tooled / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(tooled)
    # OpenAI's clients send arguments as JSON text: the template reads them as an object.
    as_sent = json.loads(json.dumps(TOOL_MESSAGES))
    as_sent[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Zürich"}'
    assert chat.render(ours, as_sent, TOOLS) == (TOOL_EXPECTED, True)
    assert chat.render(ours, PLAIN_MESSAGES)[0] == EXPECTED  # no tools: the default
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(tooled)
    assert theirs.apply_chat_template(TOOL_MESSAGES, tools=TOOLS, add_generation_prompt=True,
                                      tokenize=False) == TOOL_EXPECTED


def test_an_assistants_earlier_reasoning_reaches_the_template():
    """As transformers passes a message's fields: an assistant's `reasoning_content` (which
    Qwen3's template shows after the last question), never a user's."""

    class Reasoning(FakeTokenizer):
        chat_template = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}"
                         "({{ m.reasoning_content }}){% endif %}{{ m.content }}{% endfor %}")

    turns = [{"role": "user", "content": "4?", "reasoning_content": "not shown"},
             {"role": "assistant", "content": "Yes", "reasoning_content": "Four is even."}]
    assert chat.render(Reasoning(), turns, add_generation_prompt=False) == (
        "<user>4?<assistant>(Four is even.)Yes", True)
