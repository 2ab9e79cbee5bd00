"""Decoding with a KV cache (jaxtrain.infer.generate) against transformers' `generate` on the same
weights, and the properties of sampling, sharding and compilation that a user relies on.

The models are random tiny Llama, Mixtral, Qwen3 and Qwen3-MoE models built by transformers, imported with the real
`import-hf` verb, read back from the import's checkpoint: greedy decoding must give transformers'
tokens, one by one, and the logits each token was chosen from (fp32, <= 1e-4).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import monitoring
from jax._src.monitoring import unregister_event_duration_listener  # (jax.monitoring has no public remove)
from transformers import AutoModelForCausalLM

from jaxtrain.commands import cli
from jaxtrain.infer.generate import Generator, bucket
from jaxtrain.infer.sampling import Sampling, filter_logits
from jaxtrain.config import ConfigError
from jaxtrain.checkpoint.trained_run import restore_router_bias

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from test_hf import LLAMA3, jax_params, make_hf  # noqa: E402
from test_mixtral import make_mixtral  # noqa: E402
from test_gemma3 import VARIANTS as GEMMA3, make_gemma3  # noqa: E402
from test_qwen3 import make_qwen3  # noqa: E402
from test_gpt_oss import VARIANTS as GPT_OSS, make_gpt_oss  # noqa: E402
from test_deepseek_v3 import make_deepseek  # noqa: E402

# Prompts of different lengths in one batch (one past a prompt bucket of 16, one of a single token).
PROMPTS = [[5, 17, 3, 60, 2, 9, 41], [8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 30],
           [33, 12, 7, 7]]
NEW = 24


def hf_greedy(path: Path, prompt: list[int], new: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy continuation of one prompt and the logits of each step [new, V]."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 1)[0].numpy()


def imported(src: Path, tmp_path: Path) -> Generator:
    """A Generator of `src` imported: its parameters and, for an MoE model that has one, its routing bias."""
    out = tmp_path / "imported"
    assert cli.main(["import-hf", str(src), "--output", str(out)]) == 0
    cfg, params = jax_params(out)
    return Generator(cfg.model, params, router_bias=restore_router_bias(str(out), cfg, None))


@pytest.mark.parametrize("variant", ["gqa-untied", "tied", "llama3-rope", "head-dim-16", "mixtral", "qwen3",
                                     "qwen3-moe", "gemma3", "gpt-oss", "deepseek-v3"])
def test_greedy_decoding_equals_transformers_token_for_token(variant, tmp_path):
    src = tmp_path / "src"
    if variant == "mixtral":
        make_mixtral(src)
    elif variant == "qwen3":  # QK-norm in the cached decode path
        make_qwen3(src, tied=True)
    elif variant == "qwen3-moe":  # and routing without renormalising, dense layers between the MoE ones
        make_qwen3(src, {"norm_topk_prob": False, "decoder_sparse_step": 2, "num_hidden_layers": 4})
    elif variant == "gemma3":  # local layers' windows over the cache (prompts and continuations past them)
        make_gemma3(src, GEMMA3["untied-pattern3-linear"][0])
    elif variant == "deepseek-v3":  # MLA's cache (values narrower than keys), group routing with its bias, YaRN
        make_deepseek(src)
    elif variant == "gpt-oss":  # sinks and biases over the cache, windows of 4, YaRN, clamped SwiGLU experts
        make_gpt_oss(src, GPT_OSS["untied-biased-yarn"])
    else:
        make_hf(src, tied=variant == "tied", rope=LLAMA3 if variant == "llama3-rope" else None,
                head_dim=16 if variant == "head-dim-16" else None)
    gen = imported(src, tmp_path)
    completions = gen.generate(PROMPTS, NEW, return_logits=True)
    for prompt, c in zip(PROMPTS, completions):
        tokens, logits = hf_greedy(src, prompt, NEW)
        assert c.tokens == tokens and c.finish_reason == "length"
        assert c.logits.shape == logits.shape
        assert np.abs(logits).max() > 1.0  # a real spread: equality below is not of near-zeros
        assert np.abs(c.logits - logits).max() <= 1e-4, np.abs(c.logits - logits).max()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple:
    """(config, params) of one imported random Llama (GQA, untied), shared by the tests below."""
    tmp = tmp_path_factory.mktemp("llama")
    make_hf(tmp / "src")
    assert cli.main(["import-hf", str(tmp / "src"), "--output", str(tmp / "imported")]) == 0
    return jax_params(tmp / "imported")


def test_sampling_is_reproducible_and_top_k_1_is_greedy(llama):
    cfg, params = llama
    gen = Generator(cfg.model, params)
    nucleus = Sampling(temperature=1.0, top_p=0.9, seed=7)
    first, again = gen.generate(PROMPTS, NEW, nucleus), gen.generate(PROMPTS, NEW, nucleus)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    other = gen.generate(PROMPTS, NEW, Sampling(temperature=1.0, top_p=0.9, seed=8))
    assert [c.tokens for c in other] != [c.tokens for c in first]  # the seed matters
    greedy = gen.generate(PROMPTS, NEW)
    assert [c.tokens for c in first] != [c.tokens for c in greedy]  # sampling is not greedy
    top1 = gen.generate(PROMPTS, NEW, Sampling(temperature=0.8, top_k=1, seed=3))
    assert [c.tokens for c in top1] == [c.tokens for c in greedy]
    # A row's draws depend on its index and its positions, not on the rows beside it.
    alone = gen.generate(PROMPTS[:1], NEW, nucleus)
    assert alone[0].tokens == first[0].tokens


def test_filtering_keeps_the_top_k_then_the_smallest_set_reaching_p():
    logits = jnp.log(jnp.array([[0.5, 0.05, 0.3, 0.15]], jnp.float32))
    kept = lambda k, p: np.isfinite(np.asarray(filter_logits(logits, jnp.int32(k), jnp.float32(p))))[0].tolist()
    assert kept(0, 1.0) == [True, True, True, True]
    assert kept(2, 1.0) == [True, False, True, False]
    assert kept(0, 0.7) == [True, False, True, False]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert kept(0, 0.5) == [True, False, False, False]
    assert kept(0, 0.01) == [True, False, False, False]  # the most likely token always stays
    assert kept(3, 0.9) == [True, False, True, True]


@pytest.mark.parametrize("sizes", [{"tensor": 2, "data": 2}, {"fsdp": 4}], ids=["tensor2-data2", "fsdp4"])
def test_sharded_decoding_equals_one_device(llama, sizes):
    from helpers import mesh_of

    cfg, params = llama
    one = Generator(cfg.model, params).generate(PROMPTS, NEW, return_logits=True)
    mesh = mesh_of(**sizes)
    gen = Generator(cfg.model, params, mesh=mesh, rules=cfg.mesh.rules)
    leaf = gen.layers["blocks"][0]["attn"]["wq"]
    assert len(leaf.sharding.device_set) == mesh.size  # really spread over the mesh
    sharded = gen.generate(PROMPTS, NEW, return_logits=True)
    for a, b in zip(one, sharded):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logits, b.logits, atol=2e-5, rtol=0)


def test_no_compilation_after_warm_up_within_the_same_buckets(llama):
    cfg, params = llama
    gen = Generator(cfg.model, params)
    gen.generate(PROMPTS, NEW, Sampling(temperature=0.9, top_k=5, seed=1))
    compiles = []
    # Tracing counts too: a persistent compilation cache would hide a backend compile, not a trace.
    watched = ("/jax/core/compile/backend_compile_duration", "/jax/core/compile/jaxpr_trace_duration")
    listener = lambda event, duration, **_: compiles.append(event) if event in watched else None
    monitoring.register_event_duration_secs_listener(listener)  # (removed below: only ours, not jaxtrain's own)
    try:
        # Other prompts of the same buckets, other settings, fewer new tokens, stop strings off: nothing compiles.
        prompts = [[9] * 3, [4, 4], [1] * 17, [2] * 11]
        out = gen.generate(prompts, NEW - 5, Sampling(temperature=0.5, top_p=0.8, seed=2))
        assert [len(c.tokens) for c in out] == [NEW - 5] * 4
        gen.generate(prompts, NEW, Sampling())
    finally:
        unregister_event_duration_listener(listener)
    assert compiles == [] and gen.compilations() == 2


def test_rows_stop_at_end_of_text_and_at_stop_strings(llama):
    cfg, params = llama
    gen = Generator(cfg.model, params)
    greedy = gen.generate(PROMPTS, NEW)
    eos = greedy[0].tokens[5]  # row 0 emits this id as its 6th token: make it the end-of-text id
    ended = gen.generate(PROMPTS, NEW, eos_id=eos)
    assert ended[0].tokens == greedy[0].tokens[:6] and ended[0].finish_reason == "eos"
    for g, e in zip(greedy[1:], ended[1:]):  # the other rows run on, or end at their own first `eos`
        cut = g.tokens.index(eos) + 1 if eos in g.tokens else NEW
        assert e.tokens == g.tokens[:cut]
    words = lambda ids: " ".join(f"t{i}" for i in ids)  # a stand-in detokenizer: one word per id
    stop = f"t{greedy[1].tokens[3]} t{greedy[1].tokens[4]}"
    out = gen.generate(PROMPTS, NEW, stop=[stop], detokenize=words)
    assert out[1].finish_reason == "stop" and out[1].text == words(greedy[1].tokens[:3]) + " "
    assert out[1].tokens == greedy[1].tokens[:5] or out[1].tokens[:5] == greedy[1].tokens[:5]
    assert out[0].text == words(greedy[0].tokens) or stop in words(greedy[0].tokens)


def test_bad_requests_are_refused_in_one_line(llama):
    cfg, params = llama
    gen = Generator(cfg.model, params)
    with pytest.raises(ConfigError, match="more than the model's max_seq_len 256"):
        gen.generate([[1] * 257], 4)
    with pytest.raises(ConfigError, match="prompt 1 is empty"):
        gen.generate([[1], []], 4)
    with pytest.raises(ConfigError, match="token id 96 outside the model's vocabulary"):
        gen.generate([[1, 96]], 4)
    with pytest.raises(ConfigError, match="--max-new-tokens must be at least 1"):
        gen.generate([[1]], 0)
    with pytest.raises(ConfigError, match="--top-p must be in"):
        Sampling(temperature=1.0, top_p=0.0)


def test_layouts_decoding_cannot_serve_are_refused_by_name(llama):
    from helpers import mesh_of

    cfg, params = llama
    for axis in ("stage", "context", "expert"):
        with pytest.raises(ConfigError, match=f"decoding cannot use mesh.{axis}=2"):
            Generator(cfg.model, params, mesh=mesh_of(**{axis: 2}), rules=cfg.mesh.rules)


def test_buckets():
    assert [bucket(n, 16, 256) for n in (1, 16, 17, 200, 256)] == [16, 16, 32, 256, 256]
    assert bucket(300, 16, 256) == 256  # capped: callers refuse prompts past the cap first


def test_scores_equal_a_float64_numpy_log_softmax_of_transformers_logits(tmp_path):
    """log p(continuation | context) and greedy-ness, per request, against transformers' logits in float64."""
    src = make_hf(tmp_path / "src")
    gen = imported(src, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    requests = [([5, 17, 3], [60, 2]), ([8], [1, 2, 3, 4, 5]), ([9] * 20, [4])]
    greedy_tail = gen.generate([[7, 7, 1]], 3)[0].tokens
    requests.append(([7, 7, 1], greedy_tail))  # greedy by construction
    got = gen.score(requests, batch_size=3)  # two batches: the last one padded
    for (context, continuation), (logp, greedy) in zip(requests, got):
        whole = context + continuation
        with torch.no_grad():
            logits = model(torch.tensor([whole])).logits[0].double().numpy()
        logits -= logits.max(-1, keepdims=True)
        logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        steps = range(len(context) - 1, len(whole) - 1)
        expected = sum(logsm[i, whole[i + 1]] for i in steps)
        assert abs(logp - expected) <= 1e-4 * max(1.0, abs(expected)), (logp, expected)
        assert greedy == all(int(np.argmax(logsm[i])) == whole[i + 1] for i in steps)
    assert got[-1][1] is True
    with pytest.raises(ConfigError, match="request 0: continuation is empty"):
        gen.score([([1], [])])


def test_a_trained_moe_run_decodes_with_its_router_bias(tmp_path):
    """An MoE run trained with aux-loss-free balancing: `from_run` reads the router bias from the
    checkpoint, and decoding routes with it (each step's logits equal a full forward pass with that
    bias, and differ from one without it: a bias dropped on the way would show)."""
    from flax import nnx

    from jaxtrain.infer.loading import from_run
    from jaxtrain.model.llama import Transformer

    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(Path(__file__).resolve().parents[2] / "configs/moe-tiny.yaml"),
                     f"run.output_dir={out}", "train.steps=3", "model.router_bias_update_rate=1.0",
                     "checkpoint.compilation_cache_dir=null"]) == 0
    trained = from_run(str(out))
    bias = np.asarray(trained.router_bias)
    assert np.abs(bias).max() > 0.5  # the rate moved it (sign steps of 1.0: an odd step count ends away from 0)
    prompt, new = [3, 17, 5, 9], 6
    [c] = trained.generator().generate([prompt], new, return_logits=True)
    model = nnx.merge(nnx.split(nnx.eval_shape(lambda: Transformer(trained.cfg.model, rngs=nnx.Rngs(0))))[0],
                      trained.params)
    tokens = jnp.asarray([prompt + c.tokens[:-1]])

    def logits(router_bias):
        hidden, _ = model.hidden_and_stats(tokens, router_bias=router_bias)
        return np.asarray(jnp.einsum("bld,dv->blv", hidden, model.head_weight()))[0, len(prompt) - 1:]

    with_bias, without = logits(jnp.asarray(bias)), logits(None)
    assert np.abs(with_bias - without).max() > 1e-3  # the bias changes routing here (10x the tolerance below)
    assert np.abs(c.logits - with_bias).max() <= 1e-4, np.abs(c.logits - with_bias).max()
