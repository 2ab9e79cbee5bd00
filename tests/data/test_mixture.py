"""data.mixture: component frequencies, schedules, the document unit, resume (also onto 2 processes), a changed
mixture on resume, the component tag, and bad input.

Each component's tokens come from its own id range, so a row's tokens say which component it came from:
the checks read the rows themselves, not only the mixture's own bookkeeping.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.data import build_train_data
from jaxtrain.data.mixture import BLOCK, MixedOrder
from test_data import EOD, write_tokens

# Component k's documents use ids [RANGES[k], RANGES[k] + 20).
RANGES = {"web": 1, "code": 30, "books": 60}


def docs_of(name: str, n: int, seed: int, length: tuple[int, int] = (5, 40)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lo = RANGES[name]
    return [rng.integers(lo, lo + 20, size=rng.integers(*length)).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixture")
    return {"web": write_tokens(root / "web", docs_of("web", 300, 0)),
            "code": write_tokens(root / "code", docs_of("code", 120, 1)),
            "books": write_tokens(root / "books", docs_of("books", 40, 2, length=(100, 200)))}


def mixture_cfg(corpora, weights: dict[str, float], *extra: str, schedule: str | None = None):
    comps = ", ".join(f"{{path: '{corpora[n]}', weight: {w}, name: {n}}}" for n, w in weights.items())
    overrides = ["data.source=tokens", f"data.mixture=[{comps}]", "model.vocab_size=128", "data.seq_len=16",
                 "data.global_batch_size=8", *extra]
    if schedule:
        overrides.append(f"data.mixture_schedule={schedule}")
    return load_config(None, overrides)


def component_of_rows(batch: dict) -> np.ndarray:
    """Each row's component read from its first token's id range (independent of the `component` tag)."""
    first = np.array([row[row != EOD][0] for row in batch["tokens"]])  # a row may open on an eod
    out = np.full(len(first), -1)
    for k, lo in enumerate(RANGES.values()):
        out[(first >= lo) & (first < lo + 20)] = k
    return out


def draw(data, batches: int) -> list[dict]:
    try:
        return [next(data) for _ in range(batches)]
    finally:
        data.close()


def test_component_frequencies_are_within_binomial_bounds(corpora):
    weights = {"web": 6.0, "code": 3.0, "books": 1.0}
    batches = draw(build_train_data(mixture_cfg(corpora, weights, "data.prefetch=0")), 1250)  # 10,000 rows
    seen = np.concatenate([component_of_rows(b) for b in batches])
    tags = np.concatenate([b["component"] for b in batches])
    np.testing.assert_array_equal(seen, tags)  # the tag names the source the row really came from
    n, p = len(seen), np.array(list(weights.values())) / sum(weights.values())
    counts = np.bincount(seen, minlength=3)
    sigma = np.sqrt(n * p * (1 - p))
    assert (np.abs(counts - n * p) < 4.5 * sigma).all(), (counts, n * p, sigma)  # two-sided, ~1e-5 false alarms


def test_document_unit_weights_count_documents(corpora):
    # books' documents are ~6x longer than web's: counted in documents, equal weights give equal documents,
    # so books take ~6x the rows of web.
    cfg = mixture_cfg(corpora, {"web": 1.0, "books": 1.0}, "data.mixture_unit=documents", "data.prefetch=0")
    batches = draw(build_train_data(cfg), 500)
    seen = np.concatenate([b["component"] for b in batches])
    web_rows, books_rows = np.bincount(seen, minlength=2)
    web_docs_per_row = 300 / (sum(len(d) + 1 for d in docs_of("web", 300, 0)) / 16)
    books_docs_per_row = 40 / (sum(len(d) + 1 for d in docs_of("books", 40, 2, length=(100, 200))) / 16)
    ratio = (books_rows * books_docs_per_row) / (web_rows * web_docs_per_row)
    assert 0.85 < ratio < 1.18, ratio  # documents drawn per component: equal within sampling noise


def test_schedule_switches_at_its_step(corpora):
    cfg = mixture_cfg(corpora, {"web": 1.0, "code": 1.0}, "data.prefetch=0",
                      schedule="[{step: 40, weights: {web: 1.0}}]")
    batches = draw(build_train_data(cfg), 80)
    code_before = sum(int((b["component"] == 1).sum()) for b in batches[:40])
    code_after = sum(int((b["component"] == 1).sum()) for b in batches[40:])
    assert 120 < code_before < 200 and code_after == 0  # ~160 of 320 rows before, none after


def test_order_matches_an_independent_count(corpora):
    """locate(g) from the cached block counts (anchored anywhere) equals counting every choice from sample 0."""
    order = MixedOrder(seed=7, phase_starts=[0, 5000], probabilities=np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    choices = np.concatenate([order.choices(b) for b in range(4)])
    for g in [0, 1, BLOCK - 1, BLOCK, BLOCK + 17, 3 * BLOCK + 5, 4 * BLOCK - 1]:
        c, j = order.locate(g)
        assert c == choices[g] and j == int((choices[:g] == c).sum())
    true_at = lambda g: np.bincount(choices[:g], minlength=3)  # noqa: E731
    order.set_anchor(BLOCK + 100, true_at(BLOCK + 100))  # a resume mid-block
    for g in [BLOCK + 100, BLOCK + 101, 2 * BLOCK, 3 * BLOCK + 9]:
        np.testing.assert_array_equal(order.counts_at(g), true_at(g))
    with pytest.raises(ValueError):
        order.counts_at(BLOCK)


def test_resume_gives_the_same_batches_also_onto_two_processes(corpora):
    cfg = mixture_cfg(corpora, {"web": 5.0, "code": 2.0, "books": 1.0}, "data.prefetch=2",
                      schedule="[{step: 7, weights: {web: 1, books: 3}}]")
    whole = draw(build_train_data(cfg), 12)
    first = build_train_data(cfg)
    draw(first, 5)
    state = first.get_state()
    assert state["component_rows"] == {n: int(sum((b["component"] == k).sum() for b in whole[:5]))
                                       for k, n in enumerate(["web", "code", "books"])}
    resumed = build_train_data(cfg)
    resumed.set_state(state)
    rest = draw(resumed, 7)
    halves = []
    for p in range(2):
        part = build_train_data(cfg, p, 2)
        part.set_state(state)
        halves.append(draw(part, 7))
    for k in range(7):
        for key in whole[5 + k]:
            np.testing.assert_array_equal(rest[k][key], whole[5 + k][key])
            np.testing.assert_array_equal(np.concatenate([halves[0][k][key], halves[1][k][key]]), whole[5 + k][key])


def test_skip_batches_equals_consuming_them(corpora):
    cfg = mixture_cfg(corpora, {"web": 1.0, "code": 1.0}, "data.prefetch=0")
    a, b = build_train_data(cfg), build_train_data(cfg)
    draw_a = [next(a) for _ in range(9)]
    b.skip_batches(6)
    for k in range(3):
        np.testing.assert_array_equal(next(b)["tokens"], draw_a[6 + k]["tokens"])
    assert a.get_state() == b.get_state()
    a.close(), b.close()


def test_a_changed_mixture_starts_a_new_order_from_the_resumed_batch(corpora, caplog):
    old = mixture_cfg(corpora, {"web": 1.0, "code": 1.0}, "data.prefetch=0", "data.shuffle=false")
    first = build_train_data(old)
    given = draw(first, 10)
    state = first.get_state()
    new = mixture_cfg(corpora, {"web": 1.0, "code": 1.0, "books": 2.0}, "data.prefetch=0", "data.shuffle=false")
    resumed = build_train_data(new)
    with caplog.at_level(logging.WARNING, logger="jaxtrain.data.mixture"):
        resumed.set_state(state)
    assert "data.mixture changed since the checkpoint" in caplog.text and "from batch 10" in caplog.text
    after = draw(resumed, 30)
    seen = np.concatenate([b["component"] for b in after])
    assert (seen == 2).sum() > 0  # the new component is drawn from the resumed batch on
    # web and code continue their own order: with shuffle off, web's next row is the one after those it gave
    # (no row repeats before its epoch ends).
    web_given = [r for b in given for r, c in zip(b["tokens"], b["component"]) if c == 0]
    web_next = [r for b in after for r, c in zip(b["tokens"], b["component"]) if c == 0]
    from jaxtrain.data.packing import SequenceSource
    from jaxtrain.data.sources import open_tokens
    rows = SequenceSource(open_tokens(str(corpora["web"]), token_dtype="uint16", eod_id=None, vocab_size=128), 16)
    for i, r in enumerate(web_given + web_next[:5]):
        np.testing.assert_array_equal(r, rows[i]["tokens"])


def test_metrics_fields_count_rows_and_tokens(corpora):
    cfg = mixture_cfg(corpora, {"web": 1.0, "code": 1.0}, "data.prefetch=0")
    data = build_train_data(cfg)
    batches = draw(data, 4)
    stats = data.batch_stats(3)
    assert stats["data_rows"] == {"web": int((batches[3]["component"] == 0).sum()),
                                  "code": int((batches[3]["component"] == 1).sum())}
    total = {n: int(sum((b["component"] == k).sum() for b in batches)) * 16 for k, n in enumerate(["web", "code"])}
    assert stats["data_tokens"] == total


@pytest.mark.parametrize("mixture, schedule, pattern", [
    ("[{path: X, weight: 0}]", None, r"data.mixture\[0\].weight must be a positive number"),
    ("[{path: X, weight: -1}]", None, r"data.mixture\[0\].weight must be a positive number"),
    ("[{path: X}]", None, r"data.mixture\[0\].weight must be a positive number"),
    ("[{weight: 1}]", None, r"data.mixture\[0\] needs a path"),
    ("[{path: X, weight: 1, colour: red}]", None, r"unknown key\(s\) colour"),
    ("[{path: X, weight: 1}, {path: X, weight: 1}]", None, r"component names repeat"),
    ("[{path: X, weight: 1, eval_only: true}]", None, r"only eval_only components"),
    ("[{path: X, weight: 1}]", "[{step: 0, weights: {X: 1}}]", r"step must be an integer above"),
    ("[{path: X, weight: 1}]", "[{step: 5, weights: {nope: 1}}]", r"weights must map training component names"),
])
def test_bad_mixture_is_one_config_line(mixture, schedule, pattern):
    overrides = ["data.source=tokens", f"data.mixture={mixture}"]
    if schedule:
        overrides.append(f"data.mixture_schedule={schedule}")
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, overrides)


def test_bad_component_files_are_one_config_line_at_start(corpora, tmp_path):
    """A missing component path names the component; components that together fill fewer rows than one global
    batch are refused before anything starts (each process's share of the first batch would not exist)."""
    cfg = load_config(None, ["data.source=tokens", "model.vocab_size=128",
                             f"data.mixture=[{{path: '{corpora['web']}', weight: 1}}, {{path: '{tmp_path}/nope', weight: 1}}]"])
    with pytest.raises(ConfigError, match=r"data.mixture\[1\] \(nope\): .*nope' does not exist"):
        build_train_data(cfg)
    # 22 + 11 tokens (eods included): 2 + 1 rows of 16, fewer than a global batch of 8; each fills a row.
    small = {"web": write_tokens(tmp_path / "web", docs_of("web", 2, 3, length=(10, 11))),
             "code": write_tokens(tmp_path / "code", docs_of("code", 1, 4, length=(10, 11)))}
    with pytest.raises(ConfigError, match=r"^data\.mixture: the data fills 3 row\(s\) of data\.seq_len=16 tokens, "
                                          r"fewer than one global batch \(data\.global_batch_size=8\)") as e:
        build_train_data(mixture_cfg(small, {"web": 1, "code": 1}))
    assert "\n" not in str(e.value)


def test_a_mixture_of_documents_and_prompt_completion_examples(tmp_path):
    """Components of different formats mix: plain text documents and prompt/completion examples (bytes
    tokenizer), counted in documents; rows from the examples learn only completions."""
    import json

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": "plain text number %d " % i * 3}) + "\n"
                                                 for i in range(200)))
    pairs = [{"prompt": f"Q{i}: ", "completion": f"A{i}!"} for i in range(300)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    cfg = load_config(None, ["data.source=text", "model.vocab_size=257", "data.seq_len=32", "data.global_batch_size=8",
                             "data.prefetch=0", "data.mixture_unit=documents",
                             f"data.mixture=[{{path: '{tmp_path}/docs.jsonl', weight: 1}}, "
                             f"{{path: '{tmp_path}/pairs.jsonl', weight: 1, format: prompt_completion}}]"])
    data = build_train_data(cfg)
    batches = draw(data, 60)
    rows = [(b["tokens"][i], b["targets"][i], b["loss_mask"][i], int(b["component"][i]))
            for b in batches for i in range(8)]
    assert {c for *_, c in rows} == {0, 1}
    for tokens, targets, mask, c in rows:
        learned = bytes(int(t) for t, m in zip(targets, mask) if m and t < 256).decode()
        if c == 1:  # only completions ("A<i>!") and their eod are learned, never a prompt
            assert "Q" not in learned and ":" not in learned and learned.replace("A", "").replace("!", "").isdigit()
        else:  # a piece of the documents' text, and nothing of the examples
            text = bytes(int(t) for t in tokens if 0 < t < 256).decode()
            assert set(text) <= set("plain text number 0123456789") and text
    # Documents, not rows, follow the equal weights: documents drawn per component are about equal.
    from jaxtrain.data import open_rows
    sources = [open_rows(cfg, c, "test") for c in cfg.data.mixture_components()]
    drawn = [sum(c == k for *_, c in rows) * s.num_documents / len(s) for k, s in enumerate(sources)]
    assert 0.6 < drawn[0] / drawn[1] < 1.6, drawn
