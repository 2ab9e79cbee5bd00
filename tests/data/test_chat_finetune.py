"""Instruction fine-tuning of an imported Hugging Face Llama on chat data (data.format: chat).

A small random `LlamaForCausalLM` with a real BPE tokenizer (trained here, chat markers as special tokens) and
a ChatML template is saved with save_pretrained and brought in with `jaxtrain import-hf`. Conversations are
made of real text (lines of the standard library's source). Checked:
- before training, jaxtrain's held-out loss equals transformers' own loss on the assistant tokens of the same
  conversations (labels -100 elsewhere): the import, the template and the mask agree with transformers;
- the prompt contributes nothing to the gradient: replacing every target the loss mask leaves out changes the
  gradient not by one bit, while one changed assistant target does change it (and without the mask the same
  prompt change would);
- a short fine-tune lowers the loss on held-out answers.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_chat import CHATML_GEN, train_chat_tokenizer
from test_examples import conversations, write_jsonl

from jaxtrain.config import load_config
from jaxtrain.data import build_train_data
from jaxtrain.model.llama import Transformer
from jaxtrain.train.step import loss_sum

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from test_hf import jax_params, rope_config, run_cli  # noqa: E402

VOCAB = 1000  # the chat tokenizer's
SEQ = 256


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """`jaxtrain import-hf` of a random tiny Llama whose directory holds the chat tokenizer and template."""
    root = tmp_path_factory.mktemp("chat_finetune")
    src = root / "hf"
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      **rope_config({"rope_type": "default", "rope_theta": 10000.0}))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # larger than the default init, so the logits depend on the tokens clearly
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0.0, 0.1)
    model.save_pretrained(src)
    train_chat_tokenizer(src / "tokenizer.json")
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": "<|im_end|>", "chat_template": CHATML_GEN}))
    out = root / "imported"
    assert run_cli("import-hf", src, "--output", out) == 0
    return out


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_rows")
    convs = conversations(160, seed=11, max_chars=60)
    return {"train": write_jsonl(root / "train.jsonl", [{"messages": m} for m in convs[:128]]),
            "eval": write_jsonl(root / "eval.jsonl", [{"messages": m} for m in convs[128:]])}


def overrides(imported: Path, chat_files: dict[str, Path], *extra: str) -> list[str]:
    return ["data.source=text", "data.format=chat", f"data.path={chat_files['train']}",
            f"data.eval={chat_files['eval']}", f"data.seq_len={SEQ}", "data.global_batch_size=8",
            "model.attention=xla", "checkpoint.compilation_cache_dir=null", f"checkpoint.init_from={imported}", *extra]


def hf_answer_loss(hf_dir: Path, eval_file: Path) -> float:
    """transformers' mean cross-entropy per assistant token of the conversations in `eval_file`."""
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    total, count = 0.0, 0
    for line in eval_file.read_text().splitlines():
        out = tok.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids = torch.tensor([out["input_ids"]])
        labels = torch.where(torch.tensor([out["assistant_masks"]], dtype=torch.bool), ids, -100)
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
        per_token = torch.nn.functional.cross_entropy(logits, labels[0, 1:], ignore_index=-100, reduction="sum")
        total += float(per_token)
        count += int((labels[0, 1:] != -100).sum())
    return total / count


def test_prompt_targets_contribute_nothing_to_the_gradient(imported, chat_files):
    cfg, params = jax_params(imported, tuple(overrides(imported, chat_files)))
    data = build_train_data(cfg)
    batch = {k: jnp.asarray(v) for k, v in next(data).items()}
    data.close()
    mask, seg = np.asarray(batch["loss_mask"]), np.asarray(batch["segment_ids"])
    prompt = (mask == 0) & (seg > 0)  # real tokens whose target is not the assistant's
    assert prompt.sum() > 0.3 * (seg > 0).sum() and mask.sum() > 0.1 * (seg > 0).sum()

    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[0]
    grad = jax.jit(jax.grad(lambda p, b: loss_sum(p, graphdef, b)[0]))
    leaves = lambda b: [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(grad(params, b)))]
    base = leaves(batch)
    assert all(np.isfinite(g).all() for g in base) and max(np.abs(g).max() for g in base) > 0

    rng = np.random.default_rng(0)
    targets = np.asarray(batch["targets"])
    other = (targets + rng.integers(1, VOCAB, targets.shape)) % VOCAB  # a different id at every position
    prompt_changed = {**batch, "targets": jnp.asarray(np.where(mask == 0, other, targets))}
    assert np.sum(np.asarray(prompt_changed["targets"]) != targets) == np.sum(mask == 0)
    for a, b in zip(base, leaves(prompt_changed)):
        assert a.tobytes() == b.tobytes()  # bitwise: the prompt's targets are not in the gradient at all

    t = tuple(np.argwhere(mask > 0)[len(np.argwhere(mask > 0)) // 2])  # one assistant target
    answer_changed = {**batch, "targets": jnp.asarray(targets).at[t].set(int(other[t]))}
    assert any(a.tobytes() != b.tobytes() for a, b in zip(base, leaves(answer_changed)))
    # The mask is what does it: with every real token in the loss, the same prompt change moves the gradient.
    unmasked = {**batch, "loss_mask": jnp.asarray((seg > 0).astype(np.float32))}
    changed_unmasked = {**prompt_changed, "loss_mask": unmasked["loss_mask"]}
    assert any(np.abs(a - b).max() > 1e-6 for a, b in zip(leaves(unmasked), leaves(changed_unmasked)))


def test_fine_tuning_lowers_the_loss_on_held_out_answers(imported, chat_files):
    from jaxtrain.trainer import Trainer

    cfg = load_config(imported / "config.yaml", [*overrides(imported, chat_files), "train.steps=40",
                                                 "train.log_every=10", "optim.learning_rate=3e-3",
                                                 "optim.warmup_steps=0", "optim.weight_decay=0.0",
                                                 f"run.output_dir={imported.parent / 'never-written'}"])
    trainer = Trainer(cfg, console=None, write_files=False, devices=jax.devices()[:1])
    try:
        before = trainer.evaluate(0)  # the whole held-out set: mean loss per assistant token
        # The imported model before training, through jaxtrain's template, mask and packing, is transformers'.
        expected = hf_answer_loss(imported.parent / "hf", chat_files["eval"])
        assert before == pytest.approx(expected, rel=1e-4), (before, expected)
        assert trainer.fit()["exit_code"] == 0
        after = trainer.evaluate(0)
    finally:
        trainer.close()
    assert math.isfinite(after) and 0.5 < after < before - 1.0, (before, after)
    assert not (imported.parent / "never-written").exists()
