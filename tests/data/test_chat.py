"""Chat rows as token ids plus an assistant-only loss mask (jaxtrain/data/chat.py), checked against
transformers' own `apply_chat_template` on a real BPE tokenizer trained here with the chat special tokens.

Templates with `{% generation %}` blocks must give transformers' ids and `assistant_masks` exactly; templates
without them must give transformers' ids and a mask built by hand from the template's known layout. Every
mask comparison also checks that the mask shifted by one token would not pass, so a mask that is off by a
token (or all false) cannot slip through.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from real_text import EOT, stdlib_sources

from jaxtrain.config import ConfigError
from jaxtrain.data import chat
from jaxtrain.data.tokenizer import ByteTokenizer, HFTokenizer

transformers = pytest.importorskip("transformers")

CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>"]

# ChatML, written over several lines with indented block tags, so that trim_blocks/lstrip_blocks matter;
# `raise_exception`, `tojson` (which must neither HTML-escape nor escape non-ASCII), tests on `tools` (which
# transformers always defines) and on keys (set to None they are dropped), and a generation block around each reply.
CHATML_GEN = r"""{% if tools is not none %}
{{ '<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n' -}}
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
{{ '<|im_start|>' + message['role'] }}{% if 'name' in message %}{{ ' name=' + message['name'] }}{% endif %}{{ '\n' -}}
{% if 'meta' in message %}{{ message['meta'] | tojson + '\n' }}{% endif %}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' -}}
    {% else %}
{{ message['content'] + '<|im_end|>\n' -}}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\n' -}}
{% endif %}
"""

# Llama 3's layout (bos, headers, trimmed content, <|eot_id|>), with and without a generation block.
LLAMA3 = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role: ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if message['role'] == 'assistant' %}
ASSISTANT
    {%- else %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""
LLAMA3_GEN = LLAMA3.replace(
    "ASSISTANT", "        {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}")
LLAMA3_PLAIN = LLAMA3.replace("ASSISTANT", "        {{- message['content'] | trim + '<|eot_id|>' }}")

# Writes the number of messages into the first turn: each prefix renders that turn differently.
COUNTING = r"""{% for message in messages %}
{{ '<|im_start|>' + message['role'] }}{% if loop.first %}{{ ' (' ~ (messages | length) ~ ' messages)' }}{% endif %}
{{ '\n' + message['content'] + '<|im_end|>\n' -}}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\n' -}}
{% endif %}
"""

CONVERSATIONS = {
    "one_turn": [
        {"role": "user", "content": "What does `zip` do in Python?"},
        {"role": "assistant", "content": "It pairs items up:\n\n    list(zip([1, 2], 'ab'))  # [(1, 'a'), (2, 'b')]"},
    ],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse. Answer in one line."},
        {"role": "user", "content": "Sort [3, 1, 2].", "name": "ada"},
        {"role": "assistant", "content": "[1, 2, 3]"},
        {"role": "user", "content": "  And reversed?\n"},
        {"role": "assistant", "content": "  [3, 2, 1]\n\n"},  # surrounding space: Llama trims it, ChatML keeps it
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "def rev(xs):\n    return sorted(xs, reverse=True)"},
    ],
    "unicode": [
        {"role": "user", "content": "Übersetze: 日本語のテキスト 🙂👍🏽", "meta": {"html": "<b>&'\"</b>", "n": 1, "word": "naïve"}},
        {"role": "assistant", "content": "«Japanese text» — テキスト means text ✓, café vs cafe\u0301 🙂"},
    ],
    "empty_content": [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Say something?"},
        {"role": "assistant", "content": "Something."},
    ],
    "assistant_first": [
        {"role": "assistant", "content": "Hello! Ask me anything."},
        {"role": "user", "content": "Nothing, thanks."},
    ],
    "special_tokens_in_text": [
        {"role": "user", "content": "What are <|im_end|> and <|eot_id|>?", "name": None},  # None keys dropped
        {"role": "assistant", "content": "Turn markers: <|im_start|> opens one, <|eot_id|> ends one."},
    ],
}


def train_chat_tokenizer(path: Path) -> Path:
    """A byte-level BPE on the standard library's source with `<|endoftext|>` and the chat markers as
    special tokens (so they are single tokens that never merge with text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=[EOT, *CHAT_SPECIALS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in stdlib_sources(400_000)], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    return train_chat_tokenizer(tmp_path_factory.mktemp("chat_tok") / "tokenizer.json")


def tokenizer_dir(root: Path, tokenizer_json: Path, name: str, **config) -> Path:
    """A Hugging Face tokenizer directory: the tokenizer.json and a tokenizer_config.json with `config`."""
    d = root / name
    d.mkdir()
    shutil.copy(tokenizer_json, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer_json) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_dirs")
    llama_tokens = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    return {
        "chatml_gen": tokenizer_dir(root, tokenizer_json, "chatml_gen", chat_template=CHATML_GEN,
                                    eos_token={"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False,
                                               "normalized": False, "rstrip": False, "single_word": False,
                                               "special": True}),
        "llama3_gen": tokenizer_dir(root, tokenizer_json, "llama3_gen", chat_template=LLAMA3_GEN, **llama_tokens),
        # The list form, as older tokenizer_config.json files keep several templates.
        "llama3_plain": tokenizer_dir(root, tokenizer_json, "llama3_plain", **llama_tokens,
                                      chat_template=[{"name": "tool_use", "template": "{{ 'no' }}"},
                                                     {"name": "default", "template": LLAMA3_PLAIN}]),
    }


@pytest.fixture(scope="module")
def hf_tokenizers(dirs):
    return {name: transformers.AutoTokenizer.from_pretrained(str(d)) for name, d in dirs.items()}


def ours(d: Path, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """encode_chat as the pipeline will call it: the template and its tokens read from the directory."""
    tok = HFTokenizer(str(d / "tokenizer.json"))
    return chat.encode_chat(tok, chat.load_chat_template(d), messages, **chat.load_template_tokens(d))


def assert_mask_equal(mask: np.ndarray, expected: np.ndarray) -> None:
    """`mask` equals `expected`, and `expected` is specific enough that a shifted mask would not."""
    np.testing.assert_array_equal(np.asarray(mask, bool), np.asarray(expected, bool))
    assert expected.any() and not expected.all()
    for shift in (-1, 1):
        assert not np.array_equal(np.roll(expected, shift), expected), "a shifted mask would pass"


def test_the_tokenizer_knows_the_chat_markers(tokenizer_json, hf_tokenizers):
    tok = HFTokenizer(str(tokenizer_json))
    for marker in CHAT_SPECIALS:
        ids = tok.encode_batch([f"a{marker}b"])[0]
        assert tok._tok.token_to_id(marker) in ids.tolist() and len(ids) == 3
    assert type(hf_tokenizers["chatml_gen"]).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")


@pytest.mark.parametrize("template", ["chatml_gen", "llama3_gen", "llama3_plain"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_rendering_matches_transformers(dirs, hf_tokenizers, template, conversation, generation_prompt):
    messages = CONVERSATIONS[conversation]
    expected = hf_tokenizers[template].apply_chat_template(messages, tokenize=False,
                                                           add_generation_prompt=generation_prompt)
    text, _ = chat.render(chat.load_chat_template(dirs[template]), messages, add_generation_prompt=generation_prompt,
                          **chat.load_template_tokens(dirs[template]))
    assert text == expected


@pytest.mark.parametrize("template", ["chatml_gen", "llama3_gen"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_generation_blocks_give_transformers_ids_and_mask(dirs, hf_tokenizers, template, conversation):
    messages = CONVERSATIONS[conversation]
    out = hf_tokenizers[template].apply_chat_template(messages, tokenize=True, return_dict=True,
                                                      return_assistant_tokens_mask=True)
    ids, mask = ours(dirs[template], messages)
    assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape
    assert ids.tolist() == list(out["input_ids"])
    assert_mask_equal(mask, np.asarray(out["assistant_masks"], bool))
    # What the mask covers, read back: each reply and its end-of-turn marker, nothing else.
    end = "<|im_end|>" if template == "chatml_gen" else "<|eot_id|>"
    trim = (lambda s: s) if template == "chatml_gen" else str.strip
    replies = "".join(trim(m["content"]) + end for m in messages if m["role"] == "assistant")
    assert hf_tokenizers[template].decode(ids[mask].tolist(), skip_special_tokens=False) == replies


def llama3_expected(messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Llama 3's rendering built by hand, and the character ranges of the assistant turns (reply + eot)."""
    text, ranges = "<|begin_of_text|>", []
    for m in messages:
        text += f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
        body = m["content"].strip() + "<|eot_id|>"
        if m["role"] == "assistant":
            ranges.append((len(text), len(text) + len(body)))
        text += body
    return text, ranges


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_without_generation_blocks_the_mask_is_each_assistant_turn(dirs, hf_tokenizers, conversation):
    messages = CONVERSATIONS[conversation]
    hf = hf_tokenizers["llama3_plain"]
    ids, mask = ours(dirs["llama3_plain"], messages)
    assert ids.tolist() == hf.apply_chat_template(messages, tokenize=True, return_dict=False)
    text, ranges = llama3_expected(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False)
    # A token is the assistant's when one of its characters is (offsets from transformers' own encoding).
    offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assistant_chars = {c for a, b in ranges for c in range(a, b)}
    expected = np.array([any(c in assistant_chars for c in range(a, b)) for a, b in offsets])
    assert_mask_equal(mask, expected)
    replies = "".join(text[a:b] for a, b in ranges)
    assert hf.decode(ids[mask].tolist(), skip_special_tokens=False) == replies
    # With generation blocks around the same text, the mask comes out the same.
    gen_ids, gen_mask = ours(dirs["llama3_gen"], messages)
    assert gen_ids.tolist() == ids.tolist()
    np.testing.assert_array_equal(gen_mask, mask)


def test_the_bytes_tokenizer_masks_whole_characters(dirs):
    messages = CONVERSATIONS["unicode"]
    template = chat.load_chat_template(dirs["llama3_plain"])
    ids, mask = chat.encode_chat(ByteTokenizer(), template, messages, bos_token="<|begin_of_text|>")
    text, ranges = llama3_expected(messages)
    assert bytes(ids.astype(np.uint8)) == text.encode()
    expected = np.zeros(len(ids), bool)
    for a, b in ranges:
        expected[len(text[:a].encode()):len(text[:b].encode())] = True
    assert_mask_equal(mask, expected)
    assert bytes(ids[mask].astype(np.uint8)).decode() == "".join(text[a:b] for a, b in ranges)


def test_assistant_mask_takes_every_token_that_touches_a_span():
    # Tokens: [0,3) [3,5) [5,5) [5,6) [5,6) [6,9) [9,12); spans [4,6) and [9,10). The empty token at 5 lies
    # inside a span and is in (transformers' rule); the two tokens of one character at 5 are both in.
    offsets = [(0, 3), (3, 5), (5, 5), (5, 6), (5, 6), (6, 9), (9, 12)]
    got = chat.assistant_mask(offsets, [(9, 10), (4, 6)])
    assert got.tolist() == [False, True, True, True, True, False, True]
    assert chat.assistant_mask(offsets, []).tolist() == [False] * 7


def test_prompt_completion(tokenizer_json):
    tok = HFTokenizer(str(tokenizer_json))
    prompt, completion = "Write a haiku about tokens:\n", "  bytes merge to words\n  🙂 splits in four"
    ids, mask = chat.encode_prompt_completion(tok, prompt, completion, tok.eod_id)
    p, c = (tok.encode_batch([s])[0].tolist() for s in (prompt, completion))
    assert ids.dtype == np.int32 and mask.dtype == bool
    assert ids.tolist() == p + c + [tok.eod_id]
    expected = np.array([False] * len(p) + [True] * (len(c) + 1))
    assert_mask_equal(mask, expected)
    assert tok._tok.decode(ids[mask].tolist(), skip_special_tokens=False) == completion + EOT


def test_a_row_without_an_assistant_turn_is_refused(dirs):
    template = chat.load_chat_template(dirs["chatml_gen"])
    for messages in ([{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"}], []):
        with pytest.raises(ConfigError, match=r"no assistant turn to learn from"):
            chat.encode_chat(ByteTokenizer(), template, messages)


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer_json):
    messages = CONVERSATIONS["system_multi_turn"]
    with pytest.raises(ConfigError, match=r"^the chat template cannot yield an assistant mask: rendering the first 2 "
                                          r"messages with the generation prompt is not a prefix") as e:
        chat.encode_chat(HFTokenizer(str(tokenizer_json)), COUNTING, messages)
    assert "'2 messages)" in str(e.value) and "'7 messages)" in str(e.value) and "\n" not in str(e.value)
    # The same layout with a constant first turn is fine: the check is what refused it.
    steady = COUNTING.replace("messages | length", "7")
    _, mask = chat.encode_chat(HFTokenizer(str(tokenizer_json)), steady, messages)
    assert mask.any() and not mask.all()


def test_a_template_that_ignores_its_generation_blocks_here_is_refused(tokenizer_json):
    template = "{% for m in messages %}{% if m['role'] == 'tool' %}{% generation %}x{% endgeneration %}" \
               "{% endif %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError, match=r"generation %\} blocks marked no text"):
        chat.encode_chat(HFTokenizer(str(tokenizer_json)), template, CONVERSATIONS["one_turn"])


def test_template_errors_are_config_errors(tokenizer_json):
    tok = HFTokenizer(str(tokenizer_json))
    bad_role = [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ConfigError, match=r"fails on this conversation: TemplateError: unknown role: tool$"):
        chat.encode_chat(tok, CHATML_GEN, bad_role)
    with pytest.raises(ConfigError, match=r"^the chat template does not parse \(line 1\)"):
        chat.render("{% for m in messages %}{{ m }", [])
    # The sandbox: templates cannot change their inputs.
    with pytest.raises(ConfigError, match=r"SecurityError"):
        chat.render("{{ messages.append(1) }}", [{"role": "user", "content": "x"}])


def test_load_chat_template_layouts(tmp_path, tokenizer_json, dirs):
    d = dirs["chatml_gen"]
    assert chat.load_chat_template(d) == CHATML_GEN
    assert chat.load_chat_template(d / "tokenizer.json") == CHATML_GEN
    assert chat.load_chat_template(d / "tokenizer_config.json") == CHATML_GEN
    assert chat.load_chat_template(dirs["llama3_plain"]) == LLAMA3_PLAIN  # the list form's default
    assert chat.load_template_tokens(d) == {"eos_token": "<|im_end|>"}  # an AddedToken object's content
    # Newer layout: chat_template.jinja beside the config wins, for us as for transformers.
    newer = tokenizer_dir(tmp_path, tokenizer_json, "newer", chat_template="{{ 'old' }}")
    (newer / "chat_template.jinja").write_text(LLAMA3_GEN)
    assert chat.load_chat_template(newer) == LLAMA3_GEN
    assert transformers.AutoTokenizer.from_pretrained(str(newer)).chat_template == LLAMA3_GEN
    assert chat.load_chat_template(newer / "chat_template.jinja") == LLAMA3_GEN


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path, tokenizer_json):
    bare = tokenizer_dir(tmp_path, tokenizer_json, "bare", eos_token=EOT)
    with pytest.raises(ConfigError, match=rf"^no chat template: '{bare / 'tokenizer_config.json'}' has no chat_template"):
        chat.load_chat_template(bare)
    with pytest.raises(ConfigError, match=r"^no chat template: '.*nowhere' does not exist$"):
        chat.load_chat_template(tmp_path / "nowhere")
    unnamed = tokenizer_dir(tmp_path, tokenizer_json, "unnamed", chat_template=[{"name": "rag", "template": "x"}])
    with pytest.raises(ConfigError, match=r"none named 'default'"):
        chat.load_chat_template(unnamed)


def test_template_variables_reach_the_template_as_in_transformers(dirs, hf_tokenizers):
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b → c"}}]
    messages = CONVERSATIONS["one_turn"]
    expected = hf_tokenizers["chatml_gen"].apply_chat_template(messages, tools=tools, tokenize=False)
    text, spans = chat.render(CHATML_GEN, messages, tools=tools)
    assert text == expected and text.startswith('<|im_start|>system\nTools: [{"type": "function"')
    assert [text[a:b] for a, b in spans] == [messages[1]["content"] + "<|im_end|>"]
