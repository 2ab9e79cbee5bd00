"""`jaxtrain eval` and `jaxtrain generate` on a run trained here on real text (the standard library's
source, a BPE tokenizer trained on it), through the real CLI.

eval is checked against an independent computation: the exported model in transformers, float64,
document by document over the very rows the evaluation packs (each segment with its own positions),
and against the run's own evaluation at the same step; it covers every token once, on 1 and 2
processes. generate's text comes from the run's tokenizer and stops where asked.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import TINY, free_port, read_jsonl
from real_text import make_real_text

from jaxtrain.commands import cli
from jaxtrain.config import ConfigError, load_config
from jaxtrain.runtime import env

L = 64
STEPS = 20


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny model trained 20 steps on real text, evaluated on the held-out files at its last step."""
    root = tmp_path_factory.mktemp("real")
    text = make_real_text(root, vocab_size=512, max_bytes=300_000)
    out = root / "run"
    code = cli.main(["train", "--config", TINY, f"run.output_dir={out}", "data.source=tokens", f"data.path={text.train}",
                     f"data.eval={text.eval}", "model.vocab_size=512", f"data.seq_len={L}", f"model.max_seq_len={L}",
                     f"train.steps={STEPS}", f"train.eval_every={STEPS}", "checkpoint.every_steps=10",
                     "checkpoint.compilation_cache_dir=null", "model.attention=xla"])
    assert code == 0
    return text, out


def eval_json(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert cli.main(["eval", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_equals_the_runs_own_evaluation_and_covers_every_token_once(run, capsys):
    text, out = run
    got = eval_json(capsys, out, "--data", text.eval)
    final = [r for r in read_jsonl(out / "metrics.jsonl") if "eval_loss" in r][-1]
    assert final["step"] == STEPS and got["step"] == STEPS
    assert abs(got["loss"] - final["eval_loss"]) <= 1e-5 and got["tokens"] == final["eval_tokens"]
    meta = json.loads((text.eval / "meta.json").read_text())
    assert got["tokens"] == meta["num_tokens"] - meta["num_documents"]
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]))
    earlier = eval_json(capsys, out, "--data", text.eval, "--step", 10)
    assert earlier["step"] == 10 and earlier["loss"] > got["loss"]  # 10 more steps learned something


def test_eval_equals_transformers_in_float64_over_the_same_rows(run, tmp_path, capsys):
    """The reference: the exported model in torch float64, one forward pass per document segment of
    each packed eval row (its positions restart with the document), log-softmax at every target the
    loss mask counts."""
    from transformers import AutoModelForCausalLM

    from jaxtrain.data import build_eval_data

    text, out = run
    assert cli.main(["export-hf", str(out), "--output", str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()
    cfg = load_config(out / "config.yaml")
    data = build_eval_data(cfg)
    total, count = 0.0, 0
    try:
        for _ in range(data.num_batches):
            batch = next(data)
            for r in range(batch["tokens"].shape[0]):
                seg, mask = batch["segment_ids"][r], batch["loss_mask"][r]
                for s in set(seg[seg > 0].tolist()):
                    cols = np.flatnonzero(seg == s)
                    ids = torch.tensor(batch["tokens"][r, cols][None].astype(np.int64))
                    pos = torch.tensor(batch["positions"][r, cols][None].astype(np.int64))
                    with torch.no_grad():
                        logp = torch.log_softmax(model(ids, position_ids=pos).logits[0], -1).numpy()
                    targets, weights = batch["targets"][r, cols], mask[cols]
                    total -= float(np.sum(weights * logp[np.arange(len(cols)), targets]))
                    count += int(weights.sum())
    finally:
        data.close()
    got = eval_json(capsys, out, "--data", text.eval)
    assert got["tokens"] == count
    assert abs(got["loss"] - total / count) <= 1e-5, (got["loss"], total / count)
    hf = eval_json(capsys, "--hf", tmp_path / "hf", "--data", text.eval)  # the export, read back by jaxtrain
    assert hf["tokens"] == count and abs(hf["loss"] - got["loss"]) <= 1e-5


def test_eval_on_text_reports_bits_per_byte(run, capsys):
    text, out = run
    got = eval_json(capsys, out, "--data", text.eval_files[0])
    raw = text.eval_files[0].read_bytes()
    assert got["source"] == "text" and got["bytes"] == len(raw.decode("utf-8").encode("utf-8"))
    assert got["bits_per_byte"] == pytest.approx(got["loss"] * got["tokens"] / math.log(2) / got["bytes"])
    assert 0.5 < got["bits_per_byte"] < 8  # a BPE model 20 steps in: above 0.5, below raw bytes


@pytest.mark.multiprocess
def test_eval_on_two_processes_equals_one(run, capsys):
    text, out = run
    one = eval_json(capsys, out, "--data", text.eval)
    port = free_port()
    procs = []
    for i in range(2):
        e = {**os.environ, env.COORDINATOR: f"127.0.0.1:{port}", env.NUM_PROCESSES: "2", env.PROCESS_ID: str(i),
             "JAX_PLATFORMS": "cpu"}
        e.pop("XLA_FLAGS", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "jaxtrain", "eval", str(out), "--data", str(text.eval),
                                       "--json", "--cpu-devices", "4"], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    two = json.loads(outs[0][0].strip().splitlines()[-1])
    assert not [x for x in outs[1][0].splitlines() if x.startswith("{")]  # process 0 reports (gloo's own lines aside)
    assert two["tokens"] == one["tokens"] and abs(two["loss"] - one["loss"]) <= 1e-5


def test_generate_reads_the_runs_tokenizer_and_stops_where_asked(run, capsys):
    from jaxtrain.infer.loading import from_run

    text, out = run
    capsys.readouterr()
    assert cli.main(["generate", str(out), "--prompt", "def ", "--prompt", "import os\n", "--max-new-tokens", "12",
                     "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    trained = from_run(str(out))
    ids = trained.encode(["def ", "import os\n"])
    direct = trained.generator().generate(ids, 12, eos_id=trained.eos_id, detokenize=trained.tokenizer.decode)
    assert [x["tokens"] for x in lines] == [c.tokens for c in direct]
    assert [x["text"] for x in lines] == [c.text for c in direct] and lines[0]["text"]
    assert lines[0]["text"] == trained.tokenizer.decode(lines[0]["tokens"])
    # A stop string cut from the greedy text: the output ends just before it.
    full = lines[0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert cli.main(["generate", str(out), "--prompt", "def ", "--max-new-tokens", "12", "--stop", stop, "--json"]) == 0
    cut = json.loads(capsys.readouterr().out.strip())
    assert cut["finish_reason"] == "stop" and cut["text"] == full[:full.index(stop)]
    # Sampling with a seed is reproducible through the CLI.
    sampled = []
    for _ in range(2):
        assert cli.main(["generate", str(out), "--prompt", "def ", "--temperature", "1.0", "--top-p", "0.9",
                         "--seed", "4", "--max-new-tokens", "12", "--json"]) == 0
        sampled.append(json.loads(capsys.readouterr().out.strip())["tokens"])
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize("args,message", [
    (["generate", "{missing}", "--prompt", "x"], "has no config.yaml"),
    (["generate", "{run}", "--step", "7", "--prompt", "x"], "checkpoint step 7 of"),
    (["generate", "{run}", "--prompt", "x " * 200], "more than the model's max_seq_len 64"),
    (["generate", "{run}"], "no prompt"),
    (["generate", "{run}", "--prompt", "x", "--mesh", "stage=2"], "--mesh: 'stage=2' is not AXIS=N"),
    (["generate", "{run}", "--prompt", "x", "--top-p", "0"], "--top-p must be in"),
    (["eval", "{missing}", "--data", "{eval}"], "has no config.yaml"),
    (["eval", "{run}", "--data", "{run}/nothing-here"], "no token files"),
    (["eval", "{run}", "--step", "3", "--data", "{eval}"], "checkpoint step 3 of"),
])
def test_bad_input_is_one_line_and_exit_2(run, args, message, capsys, tmp_path):
    text, out = run
    argv = [a.format(run=out, missing=tmp_path / "nope", eval=text.eval) for a in args]
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_tokenizer_of_another_model_is_refused(run, tmp_path):
    from jaxtrain.infer.loading import Trained
    from jaxtrain.data.tokenizer import load_tokenizer

    text, out = run
    cfg = load_config(out / "config.yaml", ["model.vocab_size=256"], need_data=False)
    with pytest.raises(ConfigError, match="has 512 ids, more than the model's vocabulary of 256"):
        Trained(cfg=cfg, params={}, tokenizer=load_tokenizer(str(text.tokenizer)), source="x")
