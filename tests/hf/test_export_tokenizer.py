"""export-hf of a run trained on real tokenized text: the export carries the run's tokenizer.

A byte-level BPE is trained at test time on the Python standard library's `json` package source,
`jaxtrain prepare-data` tokenizes the same files with it (meta.json names the tokenizer and its
`<|endoftext|>` eod id), a tiny model trains a few steps on the token files, and export-hf writes
it out. transformers then loads the export as any Hugging Face model: `AutoTokenizer` works, the
bos/eos/pad ids are the eod id, and `generate` stops at eos. The trained run is shared by the
module's tests; variants rewrite a copy of its config.yaml (export reads only config + checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import TINY
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from jaxtrain.commands import cli

EOT = "<|endoftext|>"
VOCAB = 512  # the tokenizer's; the model's is a little larger (room for an appended eod id)
MODEL_VOCAB = 520
TRAIN = ["model.attention=xla", f"model.vocab_size={MODEL_VOCAB}", "data.seq_len=32", "data.global_batch_size=8",
         "train.steps=2", "train.log_every=1", "optim.warmup_steps=0", "checkpoint.compilation_cache_dir=null",
         "mesh.data=8"]
SAMPLE = 'def dumps(obj, *, indent=None):\n    """Serialize ``obj`` to a JSON formatted ``str``."""\n'


def corpus_files() -> list[Path]:
    """Real text: the source files of the standard library's json package, wherever Python lives."""
    return sorted(Path(os.path.dirname(json.__file__)).glob("*.py"))


def train_tokenizer(path: Path, special: bool = True) -> Path:
    """A byte-level BPE of VOCAB ids on corpus_files(); with `special`, `<|endoftext|>` is one of them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOT] if special else [], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in corpus_files()], trainer)
    tok.save(str(path))
    return path


def run_cli(*args) -> int:
    return cli.main([str(a) for a in args])


def exported_files_are_ordinary(folder: Path) -> None:
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()}
    assert set(modes.values()) == {"0o644"}, modes


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """The tokenizer, token files and a run trained on them (under umask 022)."""
    root = tmp_path_factory.mktemp("tok")
    (root / "bpe").mkdir()
    tokenizer = train_tokenizer(root / "bpe" / "tokenizer.json")
    tokens, run = root / "tokens", root / "run"
    assert run_cli("prepare-data", "--input", *corpus_files(), "--output", tokens, "--tokenizer", tokenizer) == 0
    meta = json.loads((tokens / "meta.json").read_text())
    assert meta["tokenizer"] == str(tokenizer.resolve())
    eod = Tokenizer.from_file(str(tokenizer)).token_to_id(EOT)
    assert meta["eod_id"] == eod
    # No data.tokenizer: the tokenizer is known only from the token files' meta.json.
    assert run_cli("train", "--config", TINY, f"run.output_dir={run}", "data.source=tokens",
                   f"data.path={tokens}", *TRAIN) == 0
    return {"root": root, "tokenizer": tokenizer, "tokens": tokens, "run": run, "eod": eod}


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_export_of_a_token_file_run_loads_in_transformers_with_its_tokenizer(trained, tmp_path, umask_022, capsys):
    exported, eod = tmp_path / "exported", trained["eod"]
    assert run_cli("export-hf", trained["run"], "--output", exported) == 0
    out = capsys.readouterr().out
    assert (exported / "tokenizer.json").read_bytes() == trained["tokenizer"].read_bytes()
    exported_files_are_ordinary(exported)
    assert f"eos id {eod}" in out, out
    for name in ("config.json", "generation_config.json"):
        ids = json.loads((exported / name).read_text())
        assert [ids.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [eod] * 3, name

    tok = AutoTokenizer.from_pretrained(exported)
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (EOT, eod, eod, eod)
    ids = tok(SAMPLE)["input_ids"]
    assert ids == Tokenizer.from_file(str(trained["tokenizer"])).encode(SAMPLE).ids  # the run's own ids
    assert tok.decode(ids) == SAMPLE

    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == eod and model.generation_config.pad_token_id == eod
    prompt = tok(SAMPLE, return_tensors="pt")["input_ids"]

    class EodAfter(LogitsProcessor):
        """Make the 4th new token eod: greedy decoding must stop there, not at max_new_tokens."""

        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == prompt.shape[1] + 3:
                scores = torch.full_like(scores, -float("inf"))
                scores[:, eod] = 0.0
            return scores

    with torch.no_grad():
        out = model.generate(prompt, do_sample=False, max_new_tokens=40,
                             logits_processor=LogitsProcessorList([EodAfter()]))
    new = out[0, prompt.shape[1]:].tolist()
    assert len(new) == 4 and new[-1] == eod, new


def test_export_of_a_text_run_takes_data_tokenizer_and_names_an_appended_eod(trained, tmp_path, umask_022):
    """data.source=text with data.tokenizer a path (no meta.json). A tokenizer without an
    end-of-text token has eod = its vocabulary size (jaxtrain.data.tokenizer): the export adds
    `<|endoftext|>` at that id so that the tokenizer can name it."""
    plain = train_tokenizer(tmp_path / "plain.json", special=False)
    assert Tokenizer.from_file(str(plain)).get_vocab_size() == VOCAB
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["data"].update(source="text", path=str(corpus_files()[0]), tokenizer=str(plain))
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    exported = tmp_path / "exported"
    assert run_cli("export-hf", run, "--output", exported) == 0
    exported_files_are_ordinary(exported)
    config = json.loads((exported / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == config["pad_token_id"] == VOCAB
    tok = AutoTokenizer.from_pretrained(exported)
    assert tok.eos_token_id == VOCAB and tok.eos_token == EOT
    assert tok(SAMPLE)["input_ids"] == Tokenizer.from_file(str(plain)).encode(SAMPLE).ids
    assert AutoModelForCausalLM.from_pretrained(exported).generation_config.eos_token_id == VOCAB


def test_a_tokenizer_gone_since_training_is_named_and_the_ids_still_written(trained, tmp_path, capsys):
    """meta.json names a tokenizer that is no longer on disk: the export goes on without tokenizer
    files, says which one is missing, and still writes the eod id that meta.json records."""
    tokens, run = tmp_path / "tokens", tmp_path / "run"
    shutil.copytree(trained["tokens"], tokens)
    meta = json.loads((tokens / "meta.json").read_text())
    meta["tokenizer"] = str(tmp_path / "gone" / "tokenizer.json")
    (tokens / "meta.json").write_text(json.dumps(meta))
    shutil.copytree(trained["run"], run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["data"]["path"] = str(tokens)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    exported = tmp_path / "exported"
    capsys.readouterr()
    assert run_cli("export-hf", run, "--output", exported) == 0
    out = capsys.readouterr().out
    assert f"'{meta['tokenizer']}' is not there any more" in out and f"eos id {trained['eod']}" in out, out
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((exported / "generation_config.json").read_text())["eos_token_id"] == trained["eod"]
