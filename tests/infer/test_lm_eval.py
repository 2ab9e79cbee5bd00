"""lm-evaluation-harness on jaxtrain (`jaxtrain.infer.lm_eval_adapter`, `jaxtrain lm-eval`), checked
against lm-eval's own `hf` backend (transformers, CPU torch) on the same Hugging Face directory.

The hub is not reachable: the tasks are made here, YAML files over local jsonl (`dataset_path: json`),
from comment lines of the Python standard library: a multiple-choice task (which line's ending
follows its beginning), a generation task (`generate_until`, stop at a newline, exact match) and a
perplexity task (`loglikelihood_rolling`, texts longer than the model's 64-token window). The model
is a random tiny Llama (tests/hf/test_hf.py `make_hf`) with a byte-level BPE tokenizer trained on
the same files (tests/real_text.py), its vocabulary the tokenizer's. Both backends must give the
same accuracies, the same generated text and the same log-likelihood per request (1e-4 relative).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("lm_eval")

from jaxtrain.commands import cli  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
import test_hf  # noqa: E402
from real_text import EOT, stdlib_sources, train_tokenizer  # noqa: E402

WINDOW = 64  # the model's max_position_embeddings: lm-eval's max_length, the rolling window
TASKS = ("jt_choice", "jt_complete", "jt_text")


def comment_lines(files: list[Path], n: int) -> list[str]:
    """`n` comment lines of real prose (40-80 characters, at least 6 words), in file order."""
    out = []
    for f in files:
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            text = line.strip().removeprefix("#").strip()
            if line.strip().startswith("# ") and 40 <= len(text) <= 80 and len(text.split()) >= 6 \
                    and re.fullmatch(r"[A-Za-z0-9 ,.;:'()\-]+", text):
                out.append(text)
                if len(out) == n:
                    return out
    raise AssertionError(f"only {len(out)} comment lines found")


def split_line(line: str) -> tuple[str, str]:
    words = line.split()
    half = len(words) // 2
    return " ".join(words[:half]), " ".join(words[half:])


def write_tasks(folder: Path, lines: list[str]) -> None:
    """Three task YAMLs over jsonl files in `folder`."""
    folder.mkdir(parents=True)
    choice, complete, text = [], [], []
    for i in range(6):
        heads_tails = [split_line(lines[i + k]) for k in range(4)]
        answer = i % 4
        endings = [t for _, t in heads_tails[1:]]
        endings.insert(answer, heads_tails[0][1])
        choice.append({"question": heads_tails[0][0], "choices": endings, "answer": answer})
    for line in lines[10:14]:
        head, tail = split_line(line)
        complete.append({"prompt": head, "answer": " " + tail})
    text = [{"text": "\n".join(lines[k:k + n])} for k, n in ((14, 5), (20, 2), (22, 7))]
    tasks = {
        "jt_choice": (choice, {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                               "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                               "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}),
        "jt_complete": (complete, {"output_type": "generate_until", "doc_to_text": "{{prompt}}",
                                   "doc_to_target": "{{answer}}", "target_delimiter": "",
                                   "generation_kwargs": {"until": ["\n"], "max_gen_toks": 12, "do_sample": False},
                                   "metric_list": [{"metric": "exact_match"}]}),
        "jt_text": (text, {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                           "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                                           {"metric": "bits_per_byte"}]}),
    }
    for name, (docs, spec) in tasks.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                  "test_split": "test", **spec, "metadata": {"version": 1.0}}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    """(a Hugging Face directory: random tiny Llama + real BPE tokenizer, a folder of task YAMLs)."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("lm_eval")
    files = stdlib_sources(120_000)
    tok_path = train_tokenizer(files, root / "tokenizer.json", 320)
    vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size()
    eot = Tokenizer.from_file(str(tok_path)).token_to_id(EOT)
    hf = root / "hf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_hf, "VOCAB", vocab)  # the model's vocabulary is the tokenizer's
        test_hf.make_hf(hf)
    for name, extra in (("config.json", {"max_position_embeddings": WINDOW}), ("generation_config.json", {})):
        cfg = json.loads((hf / name).read_text())
        cfg.update(bos_token_id=eot, eos_token_id=eot, **extra)  # <|endoftext|>, as jaxtrain's tokenizer reads it
        (hf / name).write_text(json.dumps(cfg, indent=2))
    (hf / "tokenizer.json").write_bytes(tok_path.read_bytes())
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "clean_up_tokenization_spaces": False}))
    tasks = root / "tasks"
    write_tasks(tasks, comment_lines(files, 30))
    return hf, tasks


def evaluate(model: str, model_args: str, tasks: Path, **kwargs) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), log_samples=True,
                                   task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                                   **kwargs)


@pytest.fixture(scope="module")
def ours(setup) -> dict:
    """jaxtrain's results of the three tasks, per-sample logs included."""
    import jaxtrain.infer.lm_eval_adapter  # noqa: F401  (registers "jaxtrain")

    hf, tasks = setup
    return evaluate("jaxtrain", f"hf={hf},batch_size=4", tasks, batch_size=1)  # (model_args win)


@pytest.fixture(scope="module")
def both(setup, ours) -> tuple[dict, dict]:
    """(jaxtrain's results, lm-eval hf backend's results)."""
    pytest.importorskip("accelerate")  # the hf backend's (lm-eval's `hf` extra)
    hf, tasks = setup
    return ours, evaluate("hf", f"pretrained={hf},dtype=float32", tasks, batch_size=1, device="cpu")


def by_doc(results: dict, task: str) -> dict[int, dict]:
    return {s["doc_id"]: s for s in results["samples"][task]}


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * max(1.0, abs(b))


def test_multiple_choice_equals_the_hf_backend(both):
    ours, theirs = both
    mine, ref = by_doc(ours, "jt_choice"), by_doc(theirs, "jt_choice")
    assert len(ref) == 6 and mine.keys() == ref.keys()
    for doc in ref:
        got = [r[0] for r in mine[doc]["resps"]]
        want = [r[0] for r in ref[doc]["resps"]]
        assert len(got) == len(want) == 4
        for (lp, greedy), (lp_ref, greedy_ref) in zip(got, want):
            assert close(lp, lp_ref), (doc, lp, lp_ref)
            assert greedy == greedy_ref
        assert len({round(lp, 3) for lp, _ in want}) > 1  # the choices are told apart
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["jt_choice"][metric] == theirs["results"]["jt_choice"][metric]


def test_generation_equals_the_hf_backend(both):
    ours, theirs = both
    mine, ref = by_doc(ours, "jt_complete"), by_doc(theirs, "jt_complete")
    assert len(ref) == 4 and mine.keys() == ref.keys()
    for doc in ref:
        assert mine[doc]["resps"] == ref[doc]["resps"], doc
        assert "\n" not in mine[doc]["resps"][0][0]
    assert any(ref[doc]["resps"][0][0] for doc in ref)  # something was generated
    assert ours["results"]["jt_complete"]["exact_match,none"] == theirs["results"]["jt_complete"]["exact_match,none"]


def test_rolling_loglikelihood_equals_the_hf_backend(both, setup):
    from tokenizers import Tokenizer

    ours, theirs = both
    mine, ref = by_doc(ours, "jt_text"), by_doc(theirs, "jt_text")
    assert len(ref) == 3 and mine.keys() == ref.keys()
    tok = Tokenizer.from_file(str(setup[0] / "tokenizer.json"))
    assert max(len(tok.encode(ref[d]["doc"]["text"]).ids) for d in ref) > 2 * WINDOW  # several windows
    for doc in ref:
        assert close(mine[doc]["resps"][0][0], ref[doc]["resps"][0][0]), doc
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        got, want = ours["results"]["jt_text"][metric], theirs["results"]["jt_text"][metric]
        assert abs(got - want) <= 1e-4 * abs(want), metric


def test_cli_on_a_run_directory_prints_the_table_and_writes_json(setup, ours, tmp_path, capsys):
    """The same model imported as a jaxtrain run (`import-hf`), read at its checkpoint step 0."""
    hf, tasks = setup
    run = tmp_path / "run"
    assert cli.main(["import-hf", str(hf), "--output", str(run)]) == 0
    out = tmp_path / "results.json"
    capsys.readouterr()
    assert cli.main(["lm-eval", str(run), "--step", "0", "--tasks", "jt_choice,jt_text", "--include-path", str(tasks),
                     "--limit", "3", "--batch-size", "2", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "|jt_choice" in printed and "|acc" in printed and "|word_perplexity" in printed
    results = json.loads(out.read_text())
    assert set(results["results"]) == {"jt_choice", "jt_text"}
    first = [s["acc"] for s in ours["samples"]["jt_choice"] if s["doc_id"] < 3]
    assert results["results"]["jt_choice"]["acc,none"] == pytest.approx(sum(first) / 3)


def test_cli_unknown_task_is_one_line_exit_2(setup, capsys):
    hf, tasks = setup
    capsys.readouterr()
    assert cli.main(["lm-eval", "--hf", str(hf), "--tasks", "jt_choice,jt_nonesuch", "--include-path", str(tasks)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown lm-eval task 'jt_nonesuch'" in err, err


def test_cli_without_lm_eval_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed: find_spec gives None
    capsys.readouterr()
    assert cli.main(["lm-eval", "--hf", "nowhere", "--tasks", "hellaswag"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'jaxtrain[eval]'" in err, err
