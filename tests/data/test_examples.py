"""Chat and prompt/completion examples packed into rows (jaxtrain/data/examples.py).

Rows are checked against a layout built by hand, against transformers' own `apply_chat_template(...,
return_assistant_tokens_mask=True)` on conversations made of real text (through `build_train_data`, the whole
reading path, on 1 and on 2 processes), and against the model: a packed row gives every example the logits it
gets alone, so attention never crosses examples. Bad rows stop with one line naming the key and the file:line;
`jaxtrain train` on bad chat or mixture data exits 2 with that line and writes nothing.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import epoch_rows
from real_text import EOT, stdlib_sources
from test_chat import CHATML_GEN, COUNTING, tokenizer_dir, train_chat_tokenizer

from jaxtrain.config import ConfigError, load_config
from jaxtrain.data import build_train_data, path_component
from jaxtrain.data.examples import Examples, ExampleRows, encode_examples, open_example_rows
from jaxtrain.data.packing import FIELDS
from jaxtrain.data.tokenizer import HFTokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 1000  # the chat tokenizer's (train_chat_tokenizer)


# ----------------------------------------------------------------------------- real conversations


def real_lines(max_chars: int) -> list[str]:
    """Non-trivial lines of the standard library's source, stripped, each at most `max_chars` long."""
    out = []
    for f in stdlib_sources(300_000):
        out += [s.strip() for s in f.read_text(encoding="utf-8", errors="replace").splitlines()
                if 8 <= len(s.strip()) <= max_chars]
    return out


def conversations(n: int, *, seed: int = 0, max_turns: int = 3, max_chars: int = 80) -> list[list[dict]]:
    """`n` conversations whose turns are consecutive lines of real code: the user gives a line, the
    assistant the next one; every third starts with a system message."""
    lines = real_lines(max_chars)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(0, len(lines) - 2 * max_turns))
        messages = [{"role": "system", "content": "Continue the code, one line per turn."}] if i % 3 == 0 else []
        for t in range(int(rng.integers(1, max_turns + 1))):
            messages += [{"role": "user", "content": lines[k + 2 * t]},
                         {"role": "assistant", "content": lines[k + 2 * t + 1]}]
        out.append(messages)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """A Hugging Face tokenizer directory: a BPE trained here on real text with the chat markers as special
    tokens, and a ChatML template with {% generation %} blocks in its tokenizer_config.json."""
    root = tmp_path_factory.mktemp("chat_examples")
    tok = train_chat_tokenizer(root / "trained.json")
    return tokenizer_dir(root, tok, "chatml", chat_template=CHATML_GEN, eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def hf_tok(chat_dir):
    return transformers.AutoTokenizer.from_pretrained(str(chat_dir))


def chat_config(chat_dir: Path, path: Path, *extra: str):
    return load_config(None, ["data.source=text", "data.format=chat", f"data.path={path}",
                              f"data.tokenizer={chat_dir / 'tokenizer.json'}", "data.shuffle=false",
                              f"model.vocab_size={VOCAB}", "data.global_batch_size=2", *extra])


def all_rows(cfg, process_count: int = 1) -> list[dict[str, np.ndarray]]:
    """One epoch of rows, in order, through build_train_data (data.shuffle=false); with `process_count` > 1,
    processes 0..P-1 of P each read their share and each global batch is their shares one after another."""
    epoch = epoch_rows(cfg, process_count)
    return [{k: epoch[k][j] for k in FIELDS} for j in range(len(epoch["tokens"]))]


def assert_same_rows(got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        for k in FIELDS:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"row {i} {k}")


def segments(row: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Each segment of a row (its fields at that segment's positions), in order."""
    ids = [s for s in dict.fromkeys(row["segment_ids"].tolist()) if s]
    return [{k: v[row["segment_ids"] == s] for k, v in row.items()} for s in ids]


# ----------------------------------------------------------------------------- layout by hand


def small_examples() -> Examples:
    ids = [np.arange(10, 14, dtype=np.int32), np.arange(20, 23, dtype=np.int32), np.arange(30, 36, dtype=np.int32)]
    masks = [np.array(m, bool) for m in ([0, 0, 1, 1], [0, 1, 1], [0, 0, 0, 1, 1, 1])]
    return Examples(ids, masks, ["f.jsonl:1", "f.jsonl:2", "f.jsonl:3"])


def expect(tokens, targets, segment_ids, positions, loss_mask) -> dict[str, list]:
    return {"tokens": tokens, "targets": targets, "segment_ids": segment_ids, "positions": positions,
            "loss_mask": loss_mask}


def assert_rows(rows: ExampleRows, expected: list[dict[str, list]]) -> None:
    assert len(rows) == len(expected)
    for i, want in enumerate(expected):
        got = rows[i]
        assert sorted(got) == sorted(FIELDS)
        for k in FIELDS:
            assert got[k].shape == (rows.seq_len,) and got[k].dtype == (np.float32 if k == "loss_mask" else np.int32)
            assert got[k].tolist() == want[k], (i, k, got[k].tolist(), want[k])


def test_first_fit_rows_equal_the_layout_built_by_hand():
    rows = ExampleRows(small_examples(), 8, "first_fit")
    # Longest first: c (6 tokens) opens row 0 and leaves 2, too few for a (4) or b (3): both go to row 1.
    assert_rows(rows, [
        expect([30, 31, 32, 33, 34, 35, 0, 0], [31, 32, 33, 34, 35, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0],
               [0, 1, 2, 3, 4, 5, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0]),
        expect([10, 11, 12, 13, 20, 21, 22, 0], [11, 12, 13, 20, 21, 22, 0, 0], [1, 1, 1, 1, 2, 2, 2, 0],
               [0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 1, 0, 1, 1, 0, 0]),
    ])
    assert (rows.num_examples, rows.num_tokens, rows.num_loss_tokens, rows.num_truncated) == (3, 13, 7, 0)
    assert rows.padding_fraction == pytest.approx(3 / 16)


def test_concat_rows_equal_the_layout_built_by_hand():
    rows = ExampleRows(small_examples(), 8, "concat")
    # File order; c is cut after its first token and continues in row 1 as a segment of its own.
    assert_rows(rows, [
        expect([10, 11, 12, 13, 20, 21, 22, 30], [11, 12, 13, 20, 21, 22, 30, 31], [1, 1, 1, 1, 2, 2, 2, 3],
               [0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 1, 0, 1, 1, 0, 0]),
        expect([31, 32, 33, 34, 35, 0, 0, 0], [32, 33, 34, 35, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0],
               [0, 1, 2, 3, 4, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]),
    ])
    assert (rows.num_tokens, rows.num_loss_tokens) == (13, 7)
    assert rows.padding_fraction == pytest.approx(3 / 16)


def test_long_examples_are_cut_and_those_left_with_nothing_to_learn_are_dropped():
    ids = [np.arange(1, 11, dtype=np.int32), np.arange(11, 21, dtype=np.int32), np.array([5, 6], np.int32)]
    masks = [np.r_[np.zeros(3, bool), np.ones(7, bool)],  # learnable within the first 6 tokens
             np.r_[np.zeros(7, bool), np.ones(3, bool)],  # its reply lies past seq_len: nothing left
             np.array([True, False])]  # only the first token: never a target
    rows = ExampleRows(Examples(ids, masks, ["f:1", "f:2", "f:3"]), 6, "first_fit")
    assert (rows.num_examples, rows.num_documents, rows.num_truncated, rows.num_dropped, len(rows)) == (1, 1, 2, 2, 1)
    assert_rows(rows, [expect([1, 2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 0], [1] * 6, list(range(6)), [0, 0, 1, 1, 1, 0])])
    # concat cuts nothing: the second example's reply is learned in the next row.
    concat = ExampleRows(Examples(ids, masks, ["f:1", "f:2", "f:3"]), 6, "concat")
    assert (concat.num_truncated, concat.num_dropped, concat.num_loss_tokens) == (0, 1, 10)
    assert sum(float(concat[i]["loss_mask"].sum()) for i in range(len(concat))) == 10


@pytest.mark.parametrize("packing", ["first_fit", "concat"])
def test_random_examples_every_counted_target_is_a_token_to_learn(packing):
    rng = np.random.default_rng(1)
    n = 60
    ids = [rng.integers(1, 500, int(rng.integers(2, 40))).astype(np.int32) for _ in range(n)]
    masks = [rng.random(len(x)) < 0.5 for x in ids]
    rows = ExampleRows(Examples(ids, masks, [f"f:{i}" for i in range(n)]), 32, packing)
    learnable = Counter()  # (example tokens, index) of every token to learn, found through the rows
    counted = padding = 0
    for i in range(len(rows)):
        row = rows[i]
        assert row["segment_ids"][0] == 1 and np.all(np.diff(row["segment_ids"][row["segment_ids"] > 0]) >= 0)
        for seg in segments(row):
            np.testing.assert_array_equal(seg["positions"], np.arange(len(seg["tokens"])))
            np.testing.assert_array_equal(seg["targets"][:-1], seg["tokens"][1:])  # the next token, same example
        counted += int(row["loss_mask"].sum())
        padding += int(np.sum(row["segment_ids"] == 0))
        assert np.all(row["loss_mask"][row["segment_ids"] == 0] == 0)
        learnable.update((int(row["tokens"][t]), int(row["targets"][t])) for t in np.flatnonzero(row["loss_mask"]))
    cut = 32 if packing == "first_fit" else None  # first_fit keeps an example's first seq_len tokens
    expected = Counter((int(x[t - 1]), int(x[t])) for x, m in zip(ids, masks) for t in range(1, len(x[:cut])) if m[t])
    assert learnable == expected and counted == rows.num_loss_tokens
    assert padding / (len(rows) * 32) == pytest.approx(rows.padding_fraction)
    if packing == "first_fit":
        assert rows.padding_fraction < 0.1  # first-fit decreasing packs these lengths tightly


# ----------------------------------------------------------------------------- the model sees each example alone


@pytest.mark.parametrize("packing", ["first_fit", "concat"])
def test_a_packed_row_gives_each_example_its_own_logits(chat_dir, packing):
    """No attention across examples: each segment of a packed row gets the logits it gets alone."""
    from jaxtrain.model.llama import Transformer

    tok = HFTokenizer(str(chat_dir / "tokenizer.json"))
    examples = encode_examples(((f"f:{i}", {"messages": m}) for i, m in enumerate(
        conversations(12, seed=3, max_turns=1, max_chars=30))), "chat", tok, CHATML_GEN, {}, "data.path")
    rows = ExampleRows(examples, 128, packing)
    cfg = load_config(None, [f"model.vocab_size={VOCAB}", "model.d_model=32", "model.num_layers=2",
                             "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16", "model.mlp_dim=64",
                             "model.attention=xla", "model.max_seq_len=128", "data.seq_len=128"])
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    forward = jax.jit(lambda t, p, s: model(t[None], p[None], s[None])[0])
    row = max((rows[i] for i in range(len(rows))), key=lambda r: int(r["segment_ids"].max()))
    segs = segments(row)
    assert len(segs) >= 3 and sorted(set(row["segment_ids"].tolist()) - {0}) == list(range(1, len(segs) + 1))
    packed = np.asarray(forward(*(jnp.asarray(row[k]) for k in ("tokens", "positions", "segment_ids"))))
    for s, seg in enumerate(segs, 1):
        n = len(seg["tokens"])
        alone = np.asarray(forward(jnp.asarray(seg["tokens"]), jnp.arange(n), jnp.ones(n, jnp.int32)))
        np.testing.assert_allclose(packed[row["segment_ids"] == s], alone, rtol=1e-5, atol=1e-5)
    # Sanity: with one segment for the whole row the later examples see the earlier ones, and differ.
    joined = np.asarray(forward(jnp.asarray(row["tokens"]), jnp.asarray(row["positions"]),
                                jnp.ones(128, jnp.int32)))
    later = row["segment_ids"] == 2
    assert np.abs(joined[later] - packed[later]).max() > 1e-3


# ----------------------------------------------------------------------------- against transformers, end to end


def test_chat_rows_through_build_train_data_equal_transformers(chat_dir, hf_tok, tmp_path):
    convs = conversations(40, seed=0)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m, "id": i} for i, m in enumerate(convs)])
    expected = []
    for m in convs:
        out = hf_tok.apply_chat_template(m, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        expected.append((tuple(out["input_ids"]), np.asarray(out["assistant_masks"], bool)))
    assert all(mask.any() and not mask.all() for _, mask in expected)
    L = 512
    assert max(len(ids) for ids, _ in expected) <= L  # nothing cut: each example appears whole
    masks = dict(expected)
    assert len(masks) == len(convs)  # all distinct, so the tokens identify the example

    # first_fit (the default for chat): every example whole in one segment, mask shifted onto the targets.
    cfg = chat_config(chat_dir, path, f"data.seq_len={L}", "data.global_batch_size=4")
    rows = all_rows(cfg)
    # Processes 0 and 1 of 2 each read their rows of every global batch: together, the one process's rows.
    assert_same_rows(all_rows(cfg, 2), rows)
    found = []
    for row in rows:
        for seg in segments(row):
            ids = tuple(seg["tokens"].tolist())
            assert ids in masks
            np.testing.assert_array_equal(seg["loss_mask"], np.r_[masks[ids][1:], False].astype(np.float32))
            found.append(ids)
    assert Counter(found) == Counter(ids for ids, _ in expected)
    # The learned tokens, read back: each reply and its end-of-turn marker, nothing of the prompts.
    learned = [hf_tok.decode(row["targets"][row["loss_mask"] > 0].tolist(), skip_special_tokens=False) for row in rows]
    assert sorted("".join(learned).split("<|im_end|>")[:-1]) == sorted(
        m["content"] for c in convs for m in c if m["role"] == "assistant")

    # concat: the examples in file order as one stream; a target counts when it is the assistant's and not the
    # first token of an example (nothing of its own precedes it).
    L = 128
    cfg = chat_config(chat_dir, path, f"data.seq_len={L}", "data.packing=concat", "data.global_batch_size=4")
    rows = all_rows(cfg)
    assert_same_rows(all_rows(cfg, 2), rows)
    stream = np.concatenate([np.asarray(ids) for ids, _ in expected])
    learn = np.concatenate([m for _, m in expected])
    learn[np.cumsum([0] + [len(ids) for ids, _ in expected[:-1]])] = False
    tokens = np.concatenate([r["tokens"] for r in rows])
    assert len(rows) == -(-(len(stream) - 1) // L)
    np.testing.assert_array_equal(tokens[:len(stream)], stream)
    want = np.zeros(len(rows) * L, np.float32)
    want[:len(stream) - 1] = learn[1:]
    np.testing.assert_array_equal(np.concatenate([r["loss_mask"] for r in rows]), want)


def test_prompt_completion_learns_exactly_the_completion_and_eos(chat_dir, tmp_path):
    lines = real_lines(120)
    pairs = [{"prompt": lines[i] + "\n", "completion": lines[i + 1]} for i in range(0, 80, 2)]
    pairs[3]["completion"] = ""  # nothing to say: only the eos is learned
    path = write_jsonl(tmp_path / "pc.jsonl", pairs)
    cfg = load_config(None, ["data.source=text", "data.format=prompt_completion", f"data.path={path}",
                             f"data.tokenizer={chat_dir / 'tokenizer.json'}", f"model.vocab_size={VOCAB}",
                             "data.seq_len=128"])
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # the module's own logger: the `jaxtrain` logger may not propagate to caplog
    logger = logging.getLogger("jaxtrain.data.examples")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # what a Trainer's install_stderr_logging sets (not every worker made one)
    try:
        rows = open_example_rows(cfg, path_component(cfg, str(path)), "data.path")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert records[0].getMessage() == (
        f"data.path: 40 prompt_completion examples (0 cut to data.seq_len=128, 0 with nothing to learn left out), "
        f"{rows.num_tokens} tokens, {rows.num_loss_tokens} in the loss, {len(rows)} rows (first_fit), "
        f"{100 * rows.padding_fraction:.1f}% padding")
    tok = HFTokenizer(str(chat_dir / "tokenizer.json"))
    eos = tok._tok.token_to_id(EOT)
    assert tok.eod_id == eos  # the tokenizer's end-of-text: what jaxtrain's generation stops at
    by_prompt = {}
    for p in pairs:
        prompt, completion = (tok.encode_batch([p[k]])[0].tolist() for k in ("prompt", "completion"))
        by_prompt[tuple(prompt + completion + [eos])] = (len(prompt), completion + [eos])
    seen = []
    for i in range(len(rows)):
        for seg in segments(rows[i]):
            ids = tuple(seg["tokens"].tolist())
            n_prompt, learned = by_prompt[ids]
            assert seg["targets"][seg["loss_mask"] > 0].tolist() == learned
            assert np.flatnonzero(seg["loss_mask"]).tolist() == list(range(n_prompt - 1, len(ids) - 1))
            seen.append(ids)
    assert len(by_prompt) == len(pairs) and Counter(seen) == Counter(list(by_prompt))


# ----------------------------------------------------------------------------- bad input


def refused(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        build_train_data(cfg)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_bad_chat_rows_are_refused_with_their_file_and_line(chat_dir, tmp_path):
    good = {"messages": conversations(1)[0]}
    no_assistant = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    path = write_jsonl(tmp_path / "a.jsonl", [good, good, no_assistant])
    assert refused(chat_config(chat_dir, path)).startswith(
        f"data.path: {path}:3: a chat row has no assistant turn to learn from (roles: ['system', 'user'])")

    path = write_jsonl(tmp_path / "b.jsonl", [good, {"text": "a document, not a conversation"}])
    assert refused(chat_config(chat_dir, path)).startswith(
        f"data.path: {path}:2: a chat row needs 'messages', a list of {{role, content}} objects; this one has no "
        "'messages' (keys: ['text'])")
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": "Hi there"}])
    assert "has 'messages' of type str" in refused(chat_config(chat_dir, path))

    # A template without {% generation %} blocks whose prefixes do not render as prefixes: no mask to be had.
    template = tmp_path / "counting.jinja"
    template.write_text(COUNTING)
    path = write_jsonl(tmp_path / "d.jsonl", [good])
    message = refused(chat_config(chat_dir, path, f"data.chat_template={template}"))
    assert message.startswith(f"data.path: {path}:1: the chat template cannot yield an assistant mask"), message

    # The held-out set is read (and refused) before training starts, under its own key.
    eval_path = write_jsonl(tmp_path / "e.jsonl", [no_assistant])
    assert refused(chat_config(chat_dir, write_jsonl(tmp_path / "ok.jsonl", [good] * 4), f"data.eval={eval_path}")
                   ).startswith(f"data.eval: {eval_path}:1: a chat row has no assistant turn")


def test_bad_prompt_completion_rows_tokenizers_and_vocab_are_refused(chat_dir, tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a", "answer": "b"}])
    cfg = load_config(None, ["data.source=text", "data.format=prompt_completion", f"data.path={path}",
                             f"data.tokenizer={chat_dir / 'tokenizer.json'}", f"model.vocab_size={VOCAB}"])
    assert refused(cfg).startswith(f"data.path: {path}:2: a prompt_completion row needs the string fields 'prompt' "
                                   "and 'completion'; this one lacks 'completion'")
    # Every completion past data.seq_len: nothing would be learned.
    long_prompts = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x = 1\n" * 20, "completion": "y"}] * 3)
    assert refused(cfg.with_overrides(f"data.path={long_prompts}", "data.seq_len=16")) == (
        "data.path: none of the 3 examples has a token to learn within data.seq_len=16 (the answers lie past it?); "
        "raise data.seq_len or use data.packing=concat")
    chat_rows = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversations(1)[0]}])
    # The bytes tokenizer has no chat template to fall back on.
    assert refused(load_config(None, ["data.source=text", "data.format=chat", f"data.path={chat_rows}",
                                          "model.vocab_size=300"])
                   ).startswith("data.format=chat with data.tokenizer=bytes needs data.chat_template")
    # A tokenizer directory without a template.
    bare = tokenizer_dir(tmp_path, chat_dir / "tokenizer.json", "bare", eos_token=EOT)
    assert refused(chat_config(bare, chat_rows)).startswith(
        f"data.tokenizer: no chat template: '{bare / 'tokenizer_config.json'}' has no chat_template")
    # Ids past the model's vocabulary.
    message = refused(chat_config(chat_dir, chat_rows, "model.vocab_size=300"))
    assert message.startswith(f"data.path: {chat_rows}:1: token id ") and "model.vocab_size=300" in message


@pytest.mark.parametrize("case", ["chat row without an assistant turn", "template without a mask",
                                  "missing component path", "component weight 0"])
def test_train_on_bad_data_exits_2_with_one_line_naming_the_key_and_writes_nothing(chat_dir, tmp_path,
                                                                                   jaxtrain_train, case):
    good = {"messages": conversations(1)[0]}
    path = write_jsonl(tmp_path / "chat.jsonl", [good] * 8)
    overrides, expected = [f"data.path={path}"], None
    if case == "chat row without an assistant turn":
        path = write_jsonl(tmp_path / "bad.jsonl", [good] * 8 + [{"messages": [{"role": "user", "content": "Hi"}]}])
        overrides, expected = [f"data.path={path}"], f"data.path: {path}:9: a chat row has no assistant turn"
    elif case == "template without a mask":  # no {% generation %} blocks, and prefixes do not render as prefixes
        template = tmp_path / "counting.jinja"
        template.write_text(COUNTING)
        overrides.append(f"data.chat_template={template}")
        expected = f"data.path: {path}:1: the chat template cannot yield an assistant mask"
    elif case == "missing component path":
        overrides = [f"data.mixture=[{{path: '{path}', weight: 1}}, {{path: '{tmp_path}/nope', weight: 1}}]"]
        expected = f"data.mixture[1] (nope): '{tmp_path}/nope' does not exist"
    else:
        overrides = [f"data.mixture=[{{path: '{path}', weight: 1}}, {{path: '{path}', weight: 0, name: again}}]"]
        expected = "data.mixture[1].weight must be a positive number"
    run = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text("run:\n  name: chat-refused\n")
    r = jaxtrain_train("--config", str(config), "--cpu-devices", "1", "data.source=text", "data.format=chat",
                       f"data.tokenizer={chat_dir / 'tokenizer.json'}", "model.vocab_size=1000", *overrides,
                       "model.attention=xla", f"run.output_dir={run}", "train.steps=2", cwd=tmp_path, timeout=240)
    assert r.returncode == 2, r.stderr[-3000:]
    # One error line (a component read before the bad one may log its summary line first), no traceback.
    errors = [line for line in r.stderr.splitlines() if line.startswith("jaxtrain: error")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert expected in errors[0], errors[0]
    assert not run.exists()


def test_parquet_chat_rows_equal_the_jsonl_rows(chat_dir, tmp_path):
    """The same conversations from Parquet (a list of structs per row: keys a message lacks come back None, which
    transformers' rendering drops too) give the same rows as from JSON lines; errors name the row."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    convs = conversations(24, seed=5)
    convs[4][-1]["name"] = "bot"  # one message with a key the others lack
    jsonl = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in convs])
    pq.write_table(pa.Table.from_pylist([{"messages": m} for m in convs]), tmp_path / "chat.parquet")
    want = all_rows(chat_config(chat_dir, jsonl, "data.seq_len=256"))
    assert_same_rows(all_rows(chat_config(chat_dir, tmp_path / "chat.parquet", "data.seq_len=256",
                                          "data.source=parquet")), want)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": convs[0]}, {"messages": convs[1][:1]}]), bad)
    assert refused(chat_config(chat_dir, bad, "data.source=parquet")).startswith(
        f"data.path: {bad}:row 1: a chat row has no assistant turn")
