"""`train.sample_every`: text from the live parameters during training, into events.jsonl and
TensorBoard's text tab; the same text `jaxtrain generate` gives from that step's checkpoint, and a
run that samples trains exactly as one that does not."""

from __future__ import annotations

import json

import pytest
from helpers import TINY, read_jsonl
from real_text import make_real_text

from jaxtrain.commands import cli

L = 64


def train(out, text, *extra: str) -> int:
    return cli.main(["train", "--config", TINY, f"run.output_dir={out}", "data.source=tokens", f"data.path={text.train}",
                     "model.vocab_size=512", f"data.seq_len={L}", f"model.max_seq_len={L}", "train.steps=20",
                     "train.log_every=1", "checkpoint.every_steps=10", "checkpoint.compilation_cache_dir=null",
                     "model.attention=xla", *extra])


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return make_real_text(tmp_path_factory.mktemp("real"), vocab_size=512, max_bytes=300_000)


def test_samples_are_logged_equal_generate_and_leave_training_unchanged(text, tmp_path, capsys):
    sampled, plain = tmp_path / "sampled", tmp_path / "plain"
    assert train(sampled, text, "train.sample_every=10", "train.sample_prompts=['def ', 'class ']",
                 "train.sample_max_new_tokens=8") == 0
    assert train(plain, text) == 0
    losses = lambda run: [r["loss"] for r in read_jsonl(run / "metrics.jsonl")]
    assert losses(sampled) == losses(plain)  # bitwise: sampling reads the state, never changes it

    events = [e for e in read_jsonl(sampled / "events.jsonl") if e["kind"] == "samples"]
    assert [e["step"] for e in events] == [10, 20]
    last = events[-1]["samples"]
    assert [s["prompt"] for s in last] == ["def ", "class "]
    capsys.readouterr()
    assert cli.main(["generate", str(sampled), "--step", "20", "--prompt", "def ", "--prompt", "class ",
                     "--max-new-tokens", "8", "--json"]) == 0
    generated = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [g["tokens"] for g in generated] == [s["tokens"] for s in last]
    assert [g["text"] for g in generated] == [s["text"] for s in last]

    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(sampled / "tensorboard"), size_guidance={accumulator.TENSORS: 0})
    acc.Reload()
    assert "samples/0" in acc.Tags()["tensors"]
    written = [(t.step, t.tensor_proto.string_val[0].decode()) for t in acc.Tensors("samples/0")]
    assert written == [(e["step"], "def " + e["samples"][0]["text"]) for e in events]


@pytest.mark.parametrize("extra,message", [
    (["data.source=markov", "train.sample_every=5", "train.sample_prompts=['hello']"],
     "train.sample_prompts needs a tokenizer"),
    (["train.sample_every=5", "mesh.stage=2", "mesh.data=4", "model.num_layers=2", "pipeline.microbatches=2"],
     "train.sample_every=5: decoding cannot use mesh.stage=2"),
    (["train.sample_every=5", "train.sample_prompts=['']"], "train.sample_prompts' must be a list of non-empty"),
])
def test_sampling_that_cannot_run_is_refused_before_training(text, tmp_path, capsys, extra, message):
    capsys.readouterr()
    assert train(tmp_path / "run", text, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()
