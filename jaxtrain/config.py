"""Typed configuration: YAML files plus `dotted.key=value` overrides, validated in two phases.

Phase 1 (`load_config`, `validate`) checks what is knowable from the text alone: keys, types, choices and
model shape rules. Each section's dataclass checks its own keys (its `validate()` method); `validate`
calls them and then `validate_cross_section`, the rules that span sections. A field that takes a
fixed set of strings is typed `Literal[...]`: the loader, the checks, the error messages and
docs/config.md all read the allowed values from that one annotation (`choices`). Phase 2
(`jaxtrain.parallel.mesh_shape.validate_against_devices`, one call) runs after distributed init, when
the device and process counts are known, and before anything is built or written to disk.

Every user error raises `ConfigError`; the CLI turns it into one stderr line and exit code 2.
YAML is read with `yaml.safe_load`: nothing in a config is ever executed.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

FLOAT32_MAX = 3.4028234663852886e38  # the loss scale lives in float32


class ConfigError(ValueError):
    """A problem the user can fix in the config or command line (exit code 2)."""


def _require(key: str, value: Any, ok: bool, rule: str) -> None:
    """Raise the one-line `config key '<key>' <rule>, got <value>` unless `ok`."""
    if not ok:
        raise ConfigError(f"config key '{key}' {rule}, got {value}")


def literal_choices(t: Any) -> Optional[tuple]:
    """The values a `Literal[...]` type (or a Union of Literals and None) allows, else None: read from
    the annotation with `typing.get_args`, so a field's allowed values are written once, in its type."""
    origin = typing.get_origin(t)
    if origin is Literal:
        return typing.get_args(t)
    if origin is typing.Union or origin is types.UnionType:
        parts = [literal_choices(a) if a is not type(None) else (None,) for a in typing.get_args(t)]
        if all(p is not None for p in parts):
            return tuple(dict.fromkeys(c for p in parts for c in p))
    return None


def choices(section: type, name: str) -> tuple:
    """The values the Literal-typed field `name` of the section dataclass `section` allows, e.g.
    `choices(PrecisionConfig, "policy")` -> ('fp32', 'bf16', 'fp16')."""
    allowed = literal_choices(typing.get_type_hints(section)[name])
    if allowed is None:
        raise TypeError(f"{section.__name__}.{name} is not a Literal-typed field")
    return allowed


def not_a_choice(key: str, value: Any, allowed: tuple) -> ConfigError:
    """The one-line error for a value outside a Literal field's allowed values, naming them."""
    named = ", ".join("null" if c is None else str(c) for c in allowed)
    return ConfigError(f"config key '{key}' must be one of {named}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Naming, where a run writes, and its seed."""

    name: str = "run"  # human-readable run name, shown in events and TensorBoard
    output_dir: str = "runs/run"  # run directory: config.yaml, metrics.jsonl, events.jsonl, checkpoints/
    seed: int = 0  # seeds parameter init and the dropout/RNG stream
    # Consent, on a resumed run, to changes of keys that alter what was already trained (model shape,
    # data stream, optimizer and schedule, precision policy, run.seed): a list of dotted keys, e.g.
    # [train.steps], or `all`. Without it such a change stops the run with exit 2 (docs/checkpoint.md,
    # "Changed config on resume"; jaxtrain/train/config_changes.py). Not compared itself.
    allow_changes: list | str = dataclasses.field(default_factory=list)

    def validate(self) -> None:
        """The run section's own rules (Config's `validate` adds the cross-section ones)."""
        allowed = self.allow_changes
        if isinstance(allowed, str) and allowed != "all":
            raise ConfigError(f"config key 'run.allow_changes' must be a list of dotted keys or `all`, got '{allowed}'")
        for key in (allowed if isinstance(allowed, list) else []):
            if key != "all" and key not in all_keys():
                raise ConfigError(f"run.allow_changes names {_unknown_key(str(key))}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop: length, logging, gradient accumulation, evaluation, profiling (jaxtrain/trainer.py)."""

    steps: int = 100  # optimizer steps to run in total (a resumed run counts from its checkpoint)
    log_every: int = 10  # write metrics.jsonl / TensorBoard every N steps
    grad_accum: int = 1  # microbatches per step, accumulated with lax.scan
    # Evaluate on data.eval every N steps; 0: once, after the last step, when data.eval is set.
    eval_every: int = 0
    # Cap on the global batches of one evaluation, spread over the set (0 = the whole data.eval set,
    # one pass; the endless Markov held-out stream: 4 batches). metrics.jsonl reports eval_tokens.
    eval_batches: int = 0
    host_sync_every: int = 5  # steps between cross-process decisions (preemption stop, time-based saves)
    # [first, last]: trace these steps with the JAX profiler into <output_dir>/profile/, read with
    # `jaxtrain profile-summary RUN_DIR` (docs/profiling.md); empty = no trace.
    profile_steps: list = dataclasses.field(default_factory=list)
    # Every N steps (0 = never), continue sample_prompts with the current parameters; the text goes to
    # events.jsonl (`samples`) and TensorBoard's text tab (docs/generate.md).
    sample_every: int = 0
    # Prompts (text, read with the data's tokenizer); [] = one prompt, the end-of-text id alone (what the
    # model writes from a document's start). Markov data has no tokenizer: [] only.
    sample_prompts: list = dataclasses.field(default_factory=list)
    sample_max_new_tokens: int = 32  # tokens generated per prompt
    sample_temperature: float = 0.0  # 0 = greedy; above 0 sampled, seeded by run.seed and the step

    def validate(self) -> None:
        """The train section's own rules."""
        for key in ("steps", "log_every", "grad_accum", "host_sync_every", "sample_max_new_tokens"):
            _require(f"train.{key}", getattr(self, key), getattr(self, key) > 0, "must be positive")
        for key in ("eval_every", "eval_batches", "sample_every", "sample_temperature"):
            _require(f"train.{key}", getattr(self, key), getattr(self, key) >= 0, "must be >= 0")
        if not all(isinstance(p, str) and p for p in self.sample_prompts):
            raise ConfigError(f"config key 'train.sample_prompts' must be a list of non-empty strings; "
                              f"got {self.sample_prompts!r}")
        ps = self.profile_steps
        if ps and not (len(ps) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in ps)
                       and 1 <= ps[0] <= ps[1]):
            raise ConfigError(f"config key 'train.profile_steps' must be [first, last] with 1 <= first <= last "
                              f"(e.g. [10, 12]), or [] for no trace; got {ps!r}")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizer (AdamW by default), its learning-rate schedule, weight decay and gradient clipping
    (jaxtrain/train/optim.py, jaxtrain/train/schedules.py, docs/optim.md)."""

    # adamw (default); muon (orthogonalised momentum on the weight matrices, AdamW for the rest);
    # adafactor; lion; sgd (with momentum); schedule_free (schedule-free AdamW).
    name: Literal["adamw", "muon", "adafactor", "lion", "sgd", "schedule_free"] = "adamw"
    learning_rate: float = 3e-4  # peak learning rate after warmup
    warmup_steps: int = 100  # linear warmup from 0 to learning_rate
    # After the warmup: cosine or linear decay to learning_rate * min_lr_ratio at the schedule's end,
    # constant, or wsd (warmup-stable-decay: constant, then a decay over the last wsd_decay_steps).
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    min_lr_ratio: float = 0.1  # the decay ends at learning_rate * min_lr_ratio
    wsd_decay_steps: int = 0  # wsd: length of the final decay in steps (0 = a fifth of the schedule)
    wsd_decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"  # wsd: the decay's shape (sqrt: 1 - sqrt)
    weight_decay: float = 0.1  # decoupled weight decay, on the parameters weight_decay_mask names
    # Which parameters decay: all_but_norms (every parameter but norm scales; embeddings included),
    # matrices (parameters with 2 or more dims per layer: no norms, biases or sinks), none.
    weight_decay_mask: Literal["all_but_norms", "matrices", "none"] = "all_but_norms"
    b1: float = 0.9  # Adam's decay rate for the gradient mean (first moment)
    b2: float = 0.95  # Adam's decay rate for the squared gradients (second moment)
    eps: float = 1e-8  # added to Adam's denominator, for numerical stability
    grad_clip_norm: float = 1.0  # global-norm clipping threshold (0 = off)
    # Length of the warmup + decay schedule in steps (null = train.steps). Set it to the old train.steps to
    # train a finished run on past its end at the final learning rate instead of re-stretching the schedule.
    decay_steps: Optional[int] = None
    # The other optimizers' own keys (docs/optim.md); schedule_free uses b1 (its interpolation), b2 and eps.
    adafactor_decay_rate: float = 0.8  # adafactor: the second-moment decay exponent (decay 1 - t^-rate)
    adafactor_min_dim_to_factor: int = 128  # adafactor: factor the second moment of dims at least this long
    adafactor_param_scale: bool = False  # adafactor: steps relative to each parameter's RMS (lr ~1e-2 then)
    lion_b1: float = 0.9  # lion: the momentum mixed into the update's sign
    lion_b2: float = 0.99  # lion: the momentum's own decay rate
    sgd_momentum: float = 0.9  # sgd: momentum decay rate (0 = plain SGD, no state)
    sgd_nesterov: bool = False  # sgd: Nesterov momentum
    # Muon (name=muon; jaxtrain/train/muon.py, docs/optim.md "Muon"): the hidden weight matrices' momentum,
    # orthogonalised by a quintic Newton-Schulz iteration; AdamW (b1, b2, eps above) for everything else.
    muon_momentum: float = 0.95  # Muon's momentum decay rate
    muon_nesterov: bool = True  # Muon: Nesterov momentum (false: plain heavy-ball momentum)
    muon_ns_steps: int = 5  # Muon: Newton-Schulz iterations per update
    # Muon: the Newton-Schulz quintic X <- aX + b(XX^T)X + c(XX^T)^2 X (Keller Jordan's coefficients)
    muon_ns_a: float = 3.4445  # Muon: the quintic's a
    muon_ns_b: float = -4.7750  # Muon: the quintic's b
    muon_ns_c: float = 2.0315  # Muon: the quintic's c
    qk_clip: float = 0.0  # Muon: MuonClip's max-attention-logit threshold (0 = off; not built: only 0 is accepted)

    def validate(self) -> None:
        """The optim section's own rules."""
        muon_keys = ("muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_ns_a", "muon_ns_b", "muon_ns_c",
                     "qk_clip")
        if self.name != "muon":
            for key in muon_keys:  # a Muon key set for another optimizer would silently do nothing
                if getattr(self, key) != getattr(OptimConfig, key):
                    raise ConfigError(f"config key 'optim.{key}' is a Muon key: it needs optim.name=muon, not {self.name}")
        if not 0.0 <= self.muon_momentum < 1.0 or self.muon_ns_steps < 1:
            raise ConfigError("optim.muon_momentum must be within [0, 1) and optim.muon_ns_steps >= 1")
        if self.qk_clip != 0.0:
            raise ConfigError("config key 'optim.qk_clip' (MuonClip) is not built: only 0 (off) is accepted")
        for key, users in OPTIMIZER_KEYS.items():  # another optimizer's key would silently do nothing
            if self.name not in users and getattr(self, key) != getattr(OptimConfig, key):
                raise ConfigError(f"config key 'optim.{key}' is used by optim.name={' or '.join(users)} only, "
                                  f"not {self.name}")
        if not (0.0 <= self.lion_b1 < 1.0 and 0.0 <= self.lion_b2 < 1.0 and 0.0 <= self.sgd_momentum < 1.0
                and self.adafactor_decay_rate > 0 and self.adafactor_min_dim_to_factor >= 1):
            raise ConfigError("optim.lion_b1, lion_b2 and sgd_momentum must be within [0, 1), "
                              "optim.adafactor_decay_rate > 0 and adafactor_min_dim_to_factor >= 1")
        if self.name == "schedule_free" and not 0.0 < self.b1 < 1.0:
            raise ConfigError(f"optim.name=schedule_free needs optim.b1 (its interpolation) within (0, 1), got {self.b1}")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("optim.warmup_steps must be >= 0 and optim.min_lr_ratio within [0, 1]")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ConfigError(f"config key 'optim.decay_steps' must be >= 1 (null = train.steps), got {self.decay_steps}")
        if self.wsd_decay_steps < 0:
            raise ConfigError(f"config key 'optim.wsd_decay_steps' must be >= 0 (0 = a fifth of the schedule), "
                              f"got {self.wsd_decay_steps}")
        if self.schedule != "wsd":
            for key in ("wsd_decay_steps", "wsd_decay_shape"):  # would silently do nothing
                if getattr(self, key) != getattr(OptimConfig, key):
                    raise ConfigError(f"config key 'optim.{key}' is a WSD key: it needs optim.schedule=wsd, "
                                      f"not {self.schedule}")


# optim keys that only some optimizers use -> those optimizers (OptimConfig.validate refuses the key
# set away from its default for any other; Muon's keys are checked on their own).
OPTIMIZER_KEYS: dict[str, tuple[str, ...]] = {
    "b1": ("adamw", "muon", "schedule_free"), "b2": ("adamw", "muon", "schedule_free"),
    "eps": ("adamw", "muon", "schedule_free"),
    "adafactor_decay_rate": ("adafactor",), "adafactor_min_dim_to_factor": ("adafactor",),
    "adafactor_param_scale": ("adafactor",),
    "lion_b1": ("lion",), "lion_b2": ("lion",),
    "sgd_momentum": ("sgd",), "sgd_nesterov": ("sgd",),
}


DEFAULT_RULES: dict = {
    "batch": ["data", "stage", "fsdp", "expert"],  # outside the pipeline stage devices split the batch too; so do expert devices outside MoE layers
    "length": "context",  # activations' sequence dim: split over the context axis (docs/context.md)
    # the residual stream's sequence dim (norms, residual adds); [context, tensor] = sequence parallelism
    "act_length": "context",
    "embed": "fsdp",
    "vocab": "tensor",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "layers": "stage",  # the stacked layers: pipeline stages split them (jaxtrain/parallel/pipeline.py)
    "act_embed": None,  # activations' embed dim stays whole (fsdp gathers weights, not activations)
    "experts": "expert",  # MoE: the experts of a layer's stacked expert weights (expert parallelism)
    "moe_mlp": "tensor",  # MoE: each expert's SwiGLU hidden dimension
    # MLA (jaxtrain/model/mla.py): the query and key/value latents, replicated. A latent is small
    # and per token, and every head shard needs all of it to expand its heads: sharding it would
    # add an all-gather per layer to save a few hundred channels.
    "q_lora": None,
    "kv_lora": None,
}


# The mesh axes, outermost first: the one list every other place derives from (MeshConfig's size and
# dcn_* fields, validation, `jaxtrain.parallel.mesh_shape.AXES`, the device mesh). Adding an axis means
# adding it here and its fields to MeshConfig; a test checks that they agree.
MESH_AXES: tuple[str, ...] = ("data", "stage", "fsdp", "expert", "context", "tensor")
# The axes that may span the slow data-centre network (`mesh.dcn_<axis>`): all but `tensor`, whose
# per-layer collectives need the fast links.
DCN_MESH_AXES: tuple[str, ...] = tuple(a for a in MESH_AXES if a != "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh: how many ways each axis splits the devices, and the rules table that shards every
    array by its logical axis names (jaxtrain/parallel/mesh.py, sharding.py)."""

    data: int = -1  # data-parallel replicas (-1 = the devices left over)
    stage: int = 1  # pipeline stages
    fsdp: int = 1  # parameter/optimizer sharding (ZeRO-3)
    context: int = 1  # context parallelism: each sequence split over this many devices (docs/context.md)
    tensor: int = 1  # tensor (Megatron) parallelism
    expert: int = 1  # expert parallelism: MoE layers' experts split over it, the batch too outside them (docs/moe.md)
    # Of each axis, how many ways span the slow data-centre network (DCN): TPU slices, else processes.
    # Their product = the number of slices (or processes); multi-host only. None set: the granules go
    # to the outermost axes that divide by them, data first (jaxtrain/parallel/mesh.py).
    dcn_data: int = 1  # of `data`, how many replicas span slices/hosts
    dcn_stage: int = 1  # of `stage`, how many pipeline stages span slices/hosts (stages pass only activations)
    dcn_fsdp: int = 1  # of `fsdp`, how many shards span slices/hosts
    dcn_expert: int = 1  # of `expert`, how many expert groups span slices/hosts (all-to-all crosses them)
    dcn_context: int = 1  # of `context`, how many sequence shards span slices/hosts (the ring crosses DCN)
    # logical axis -> mesh axis (or list of mesh axes, or null = replicated). This one table
    # decides every parameter and activation sharding in the model. A partial table (YAML, an
    # override, or MeshConfig(rules=...) in Python) overrides its entries of DEFAULT_RULES only.
    rules: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_RULES))

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", {**DEFAULT_RULES, **self.rules})

    def validate(self) -> None:
        """The mesh section's own rules: axis sizes, DCN splits and the rules table's names. What
        needs the device count is `jaxtrain.parallel.mesh_shape.validate_against_devices`."""
        for axis in MESH_AXES:
            v = getattr(self, axis)
            if v == 0 or v < -1:
                raise ConfigError(f"config key 'mesh.{axis}' must be a positive size or -1 (fill), got {v}")
        for axis in DCN_MESH_AXES:
            if getattr(self, f"dcn_{axis}") < 1:
                raise ConfigError(f"config key 'mesh.dcn_{axis}' must be a positive size (1 = no DCN split), "
                                  f"got {getattr(self, f'dcn_{axis}')}")
        filled = [f"mesh.{a}" for a in MESH_AXES if getattr(self, a) == -1]
        if len(filled) > 1:
            raise ConfigError(f"only one mesh axis may be -1 (fill with the remaining devices), got {' and '.join(filled)}")
        known = logical_axis_names()
        for logical in self.rules:
            if logical not in known:
                close = difflib.get_close_matches(str(logical), known, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(f"mesh.rules names unknown logical axis '{logical}'{hint} (known: {', '.join(known)})")
        for logical, target in self.rules.items():
            targets = target if isinstance(target, list) else [target]
            for a in targets:
                if a is not None and a not in MESH_AXES:
                    raise ConfigError(f"mesh.rules['{logical}'] names mesh axis '{a}'; "
                                      f"valid axes are {', '.join(MESH_AXES)}")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline stages over the `stage` mesh axis; used only when mesh.stage > 1 (docs/pipeline.md)."""

    microbatches: int = 1  # microbatches each step's batch (each grad-accum microbatch) is cut into; >= mesh.stage
    repeats: int = 1  # layer groups per stage: 1 = GPipe, R > 1 = circular; bubble (S-1)/(R*M+S-1)
    # Rematerialise every pipeline iteration (keeps only the stages' inputs for the backward pass).
    # Turn off only to measure what it saves: activation memory then grows with R*M + S - 1.
    remat_iterations: bool = True
    # Run the train.grad_accum microbatches as one pipeline pass of grad_accum x microbatches, so the
    # fill/drain bubble is paid once per step, not once per accumulation microbatch. Costs activation
    # memory: the pass keeps the stage inputs of the whole step's batch (false: of one accumulation microbatch).
    fold_grad_accum: bool = True
    # All-gather each stage's FSDP-sharded weights once per pipeline pass, before its loop, instead of
    # in every one of its R*M + S - 1 iterations (MaxText's pipeline_fsdp_ag_once); their gradients are
    # then reduce-scattered once after it. Costs memory: every device holds its stage's weights and
    # weight gradients unsharded over fsdp for the whole pass.
    gather_fsdp_once: bool = False

    def validate(self) -> None:
        """The pipeline section's own rules (`validate_pipeline` checks them against a stage count)."""
        for key in ("microbatches", "repeats"):
            _require(f"pipeline.{key}", getattr(self, key), getattr(self, key) > 0, "must be positive")


@dataclasses.dataclass(frozen=True)
class ContextConfig:
    """Attention across a sequence split over the `context` mesh axis; used only when mesh.context > 1
    (jaxtrain/parallel/context.py, docs/context.md)."""

    # ring: K/V blocks pass around the context ring (ppermute), memory ~1/context; allgather: every
    # device gathers the whole K/V (MaxText's default), simpler, K/V memory not divided.
    attention: Literal["ring", "allgather"] = "ring"
    # zigzag: device i holds sequence chunks i and 2C-1-i, so causal attention work is equal on every
    # device; plain: contiguous chunks (the last device does ~2x the average work).
    order: Literal["zigzag", "plain"] = "zigzag"

    def validate(self) -> None:
        """Nothing beyond its Literal choices (`check_field_values`); `validate_context` checks the
        section against a context size."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The Llama-style decoder: its shape, rotary embedding, remat, attention kernel and mixture of experts
    (jaxtrain/model/)."""

    vocab_size: int = 256  # token ids lie in [0, vocab_size): embedding rows and output logits
    d_model: int = 128  # width of the residual stream (the embedding size)
    num_layers: int = 2  # decoder layers
    num_heads: int = 4  # attention (query) heads
    num_kv_heads: int = 4  # grouped-query attention: num_heads must be a multiple of this
    head_dim: int = 32  # width of each attention head
    mlp_dim: int = 512  # SwiGLU hidden size
    max_seq_len: int = 2048  # longest sequence the rotary tables are built for
    rope_theta: float = 10000.0  # base of the rotary position embedding's frequencies
    # Llama 3.1 long-context rope: "llama3" rescales the rotary frequencies with the four keys below
    # (the formula of Meta's reference code and transformers' `_compute_llama3_parameters`).
    # "linear" (Gemma 3's global layers) divides every position by rope_scaling_factor. With a
    # sliding window the scaling applies to the global layers only.
    # "yarn" (DeepSeek-V3, gpt-oss, Qwen3 long context): YaRN's frequency interpolation between
    # rope_yarn_beta_slow and _beta_fast rotations, and its attention factor (transformers'
    # `_compute_yarn_parameters`), with rope_scaling_factor and rope_original_max_len.
    rope_scaling: Literal["none", "llama3", "linear", "yarn"] = "none"
    rope_scaling_factor: float = 8.0  # llama3: long wavelengths are stretched by this factor; linear: positions / this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_len / this are fully scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_len / this are kept as they are
    rope_original_max_len: int = 8192  # llama3, yarn: context length the model was pretrained with
    rope_yarn_beta_fast: float = 32.0  # yarn: rotations above which a frequency is kept as it is
    rope_yarn_beta_slow: float = 1.0  # yarn: rotations below which a frequency is fully interpolated
    rope_yarn_mscale: float = 0.0  # yarn: DeepSeek's mscale (0 = unset: attention factor 0.1 ln(factor) + 1)
    rope_yarn_mscale_all_dim: float = 0.0  # yarn: DeepSeek's mscale_all_dim (0 = unset)
    rope_yarn_truncate: bool = True  # yarn: round the correction range to whole dims (gpt-oss: false)
    norm_eps: float = 1e-5  # epsilon of every RMSNorm
    # Qwen3's QK-norm: an RMSNorm over each head's channels (a [head_dim] scale shared by the heads) on
    # the projected queries and keys, before rotary.
    qk_norm: bool = False
    # Gemma 3's keys (each off by default, as Llama; docs/hf.md). Every RMSNorm scales by (1 + w), w
    # initialised at 0 (stored as w, as Gemma's checkpoints are).
    norm_plus_one: bool = False
    # Embeddings multiplied by sqrt(d_model), the factor cast to the compute dtype first (as transformers does).
    embed_scale: bool = False
    # Extra RMSNorms on the attention's and the MLP's outputs, before each residual add.
    post_norms: bool = False
    # The gated MLP's gate activation: silu (SwiGLU) or gelu with the tanh approximation (GeGLU).
    # clamped_swiglu: gpt-oss's (swiglu_limit, swiglu_alpha below).
    mlp_activation: Literal["silu", "gelu_tanh", "clamped_swiglu"] = "silu"
    # Attention scores are q.k / sqrt(this) (Gemma's query_pre_attn_scalar); 0 = head_dim.
    query_pre_attn_scalar: int = 0
    # Sliding-window attention (docs/kernels.md): > 0 = a local layer's query sees itself and the
    # sliding_window - 1 tokens before it; 0 = no window anywhere.
    sliding_window: int = 0
    # With a window: layer i is global (full causal) iff (i + 1) % this == 0 (Gemma 3: 6); 0 = every layer local.
    sliding_window_pattern: int = 0
    rope_local_theta: float = 0.0  # rotary base of the local layers (Gemma 3: 10000); 0 = rope_theta (yarn: the global rope)
    # Multi-head latent attention (DeepSeek-V2/V3; docs/models.md). kv_lora_rank > 0 replaces the q/k/v
    # projections: keys and values come from one kv_lora_rank latent (normalised) per token, each head's
    # key qk_nope_head_dim channels from it plus one qk_rope_head_dim rotary key shared by the heads, its
    # value v_head_dim channels; queries through a q_lora_rank latent (normalised; 0 = one full-rank
    # projection). model.head_dim must equal qk_nope_head_dim + qk_rope_head_dim, num_kv_heads num_heads.
    kv_lora_rank: int = 0  # MLA: the key/value latent's width (0 = grouped-query attention)
    q_lora_rank: int = 0  # MLA: the query latent's width (0 = a full-rank query projection)
    qk_rope_head_dim: int = 64  # MLA: the rotary channels of each query and of the shared key
    qk_nope_head_dim: int = 128  # MLA: each head's non-rotary query/key channels
    v_head_dim: int = 128  # MLA: each head's value channels
    # gpt-oss: a learned logit per head in every softmax's denominator (attention sinks); biases on the
    # q/k/v/o projections; biases on the router and the experts (and dense MLPs).
    attention_sinks: bool = False  # a learned sink logit per head (gpt-oss)
    attention_bias: bool = False  # biases on the q/k/v/o projections (gpt-oss)
    mlp_bias: bool = False  # biases on the router, the experts and dense MLPs (gpt-oss)
    # mlp_activation=clamped_swiglu (gpt-oss): (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
    # g = min(gate, limit).
    swiglu_limit: float = 7.0  # clamped_swiglu: the clamp
    swiglu_alpha: float = 1.702  # clamped_swiglu: the gate's sigmoid slope
    # Multi-token prediction (DeepSeek-V3 section 2.2; docs/models.md): mtp_depth sequential modules after the
    # decoder, module d predicting token t + 1 + d, sharing the embedding and the head; their mean loss,
    # times mtp_loss_weight, is added to the training loss and reported apart (metrics.jsonl mtp_loss).
    # Not exported (transformers' DeepSeek-V3 does not run them). 0 = off.
    mtp_depth: int = 0  # multi-token prediction modules (0 = off)
    mtp_loss_weight: float = 0.1  # weight of their mean loss in the training loss
    tie_embeddings: bool = False  # share the input embedding with the output head
    scan_layers: bool = True  # stack layers and lax.scan over them (compile time flat in depth)
    # Activation checkpointing (docs/pipeline.md, "Remat policies"): what the backward pass keeps of each layer
    # (of each pipeline iteration under mesh.stage > 1): none, full (nothing), minimal / dots (every
    # projection's output), save_qkv_proj, save_out_proj.
    remat: Literal["none", "full", "dots", "minimal", "save_qkv_proj", "save_out_proj"] = "none"
    # The attention kernel (kernels/, docs/kernels.md); auto picks by platform and compute dtype.
    attention: Literal["auto", "xla", "pallas", "triton", "cudnn"] = "auto"
    init_std: float = 0.02  # std of the normal weight init (output projections: / sqrt(2 * num_layers))
    # Mixture of experts (docs/moe.md; jaxtrain/model/moe.py). num_experts = 0: every MLP is dense.
    num_experts: int = 0  # routed SwiGLU experts per MoE layer
    experts_per_token: int = 2  # top-k
    moe_mlp_dim: int = 0  # each expert's hidden size (0 = mlp_dim)
    # After first_dense_layers, layer j is MoE when (j + 1) % moe_every == 0: k - 1 dense layers, then
    # one MoE layer, repeated (Llama 4 / MaxText's interleave_moe_layer_step). 1: every layer.
    moe_every: int = 1
    first_dense_layers: int = 0  # the first N layers keep a dense MLP (DeepSeek)
    num_shared_experts: int = 0  # always-on experts (one dense SwiGLU of num_shared x moe_mlp_dim) beside the routed ones
    moe_router: Literal["softmax", "sigmoid"] = "softmax"  # softmax top-k (Mixtral) or sigmoid top-k (DeepSeek-V3)
    # softmax, k > 1: the chosen k probabilities renormalised to sum to 1 (Mixtral; Qwen3-MoE's
    # norm_topk_prob: true); false: the gates are the softmax probabilities themselves (softmax only).
    moe_norm_topk_prob: bool = True
    # DeepSeek-V3's group-limited routing: the experts split into moe_n_group groups, a group scored by the
    # sum of its two best (score + bias); each token chooses among the experts of its moe_topk_group best
    # groups only. 1 and 1 = no groups.
    moe_n_group: int = 1  # expert groups (DeepSeek-V3: 8)
    moe_topk_group: int = 1  # groups a token may choose experts from (DeepSeek-V3: 4)
    moe_routed_scaling_factor: float = 1.0  # the routed experts' gates times this (DeepSeek-V3: 2.5)
    capacity_factor: float = 0.0  # > 0: capacity-padded dispatch, overflow dropped (counted); <= 0: dropless
    moe_aux_loss: float = 0.0  # weight of the Switch load-balancing loss alpha * E * sum_i f_i P_i, per MoE layer
    router_z_loss: float = 0.0  # weight of the router z-loss mean(logsumexp(router logits)**2), per MoE layer
    router_bias_update_rate: float = 0.0  # aux-loss-free balancing: bias += rate * sign(mean load - load) per step

    def layer_is_local(self, i: int) -> bool:
        """Whether layer i attends through the sliding window (model.sliding_window, _pattern)."""
        p = self.sliding_window_pattern
        return self.sliding_window > 0 and (p == 0 or (i + 1) % p != 0)

    @property
    def mixed_windows(self) -> bool:
        """Some layers local, others global: the scanned stack picks per layer (a lax.cond)."""
        return len({self.layer_is_local(i) for i in range(self.num_layers)}) > 1

    @property
    def num_moe_layers(self) -> int:
        """MoE layers in the stack (0 when dense): one in every `moe_every` after `first_dense_layers`."""
        return (self.num_layers - self.first_dense_layers) // self.moe_every if self.num_experts > 0 else 0

    def validate(self) -> None:
        """The model section's own rules: its shape, rotary embedding and mixture of experts."""
        for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                    "max_seq_len"):
            _require(f"model.{key}", getattr(self, key), getattr(self, key) > 0, "must be positive")
        self._validate_moe()
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={self.num_kv_heads} "
                "(grouped-query attention shares each kv head among num_heads/num_kv_heads query heads)")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} must be even (rotary embeddings rotate pairs)")
        if self.rope_theta <= 0:
            raise ConfigError(f"model.rope_theta={self.rope_theta} must be positive")
        if self.rope_scaling == "llama3":
            if self.rope_scaling_factor < 1.0:
                raise ConfigError(f"model.rope_scaling_factor={self.rope_scaling_factor} must be >= 1 (1 = no scaling)")
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ConfigError(f"model.rope_low_freq_factor={self.rope_low_freq_factor} must be positive and smaller "
                                  f"than model.rope_high_freq_factor={self.rope_high_freq_factor} (they bound the "
                                  "smoothed band)")
            if self.rope_original_max_len <= 0:
                raise ConfigError(f"model.rope_original_max_len={self.rope_original_max_len} must be positive")
        if self.rope_scaling == "linear" and not self.rope_scaling_factor >= 1.0:
            raise ConfigError(f"model.rope_scaling_factor={self.rope_scaling_factor} must be >= 1 (1 = no scaling)")
        for key in ("sliding_window", "sliding_window_pattern", "rope_local_theta", "query_pre_attn_scalar"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"config key 'model.{key}' must be >= 0, got {getattr(self, key)}")
        self._validate_families()
        if self.mlp_activation == "gelu_tanh" and self.num_experts > 0:
            raise ConfigError(f"model.mlp_activation={self.mlp_activation} with model.num_experts={self.num_experts}: "
                              "the experts are SwiGLU (silu or clamped_swiglu) only")

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (model.kv_lora_rank > 0)."""
        return self.kv_lora_rank > 0

    def _validate_families(self) -> None:
        """The DeepSeek-V3 and gpt-oss keys: MLA, YaRN, clamped SwiGLU, multi-token prediction."""
        for key in ("kv_lora_rank", "q_lora_rank", "mtp_depth", "rope_yarn_mscale", "rope_yarn_mscale_all_dim"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"config key 'model.{key}' must be >= 0, got {getattr(self, key)}")
        if self.mla:
            for key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
                _require(f"model.{key}", getattr(self, key), getattr(self, key) > 0, "must be positive")
            if self.qk_rope_head_dim % 2:
                raise ConfigError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary pairs)")
            if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
                raise ConfigError(f"model.head_dim={self.head_dim} must equal model.qk_nope_head_dim + "
                                  f"model.qk_rope_head_dim = {self.qk_nope_head_dim + self.qk_rope_head_dim} with "
                                  f"multi-head latent attention (model.kv_lora_rank={self.kv_lora_rank})")
            if self.num_kv_heads != self.num_heads:
                raise ConfigError(f"model.num_kv_heads={self.num_kv_heads} must equal model.num_heads={self.num_heads} "
                                  "with multi-head latent attention (every head has its own key and value)")
            for key in ("qk_norm", "sliding_window", "attention_sinks", "attention_bias"):
                if getattr(self, key):
                    raise ConfigError(f"model.{key}={getattr(self, key)} with multi-head latent attention "
                                      f"(model.kv_lora_rank={self.kv_lora_rank}) is not built (no family uses both)")
        if self.rope_scaling == "yarn":
            if not self.rope_scaling_factor >= 1.0:
                raise ConfigError(f"model.rope_scaling_factor={self.rope_scaling_factor} must be >= 1 (1 = no scaling)")
            if self.rope_original_max_len <= 0:
                raise ConfigError(f"model.rope_original_max_len={self.rope_original_max_len} must be positive")
            if not 0 < self.rope_yarn_beta_slow < self.rope_yarn_beta_fast:
                raise ConfigError(f"model.rope_yarn_beta_slow={self.rope_yarn_beta_slow} must be positive and smaller "
                                  f"than model.rope_yarn_beta_fast={self.rope_yarn_beta_fast}")
        if self.mlp_activation == "clamped_swiglu" and not (self.swiglu_limit > 0 and self.swiglu_alpha > 0):
            raise ConfigError(f"model.swiglu_limit={self.swiglu_limit} and model.swiglu_alpha={self.swiglu_alpha} "
                              "must be positive with model.mlp_activation=clamped_swiglu")
        if not self.mtp_loss_weight >= 0:
            raise ConfigError(f"config key 'model.mtp_loss_weight' must be >= 0, got {self.mtp_loss_weight}")

    def _validate_moe(self) -> None:
        """The mixture-of-experts keys (model.num_experts > 0; docs/moe.md). mesh.expert without
        experts is a cross-section check (`validate_cross_section`)."""
        if self.num_experts < 0:
            raise ConfigError(f"model.num_experts={self.num_experts} must be >= 0 (0 = dense MLPs)")
        if self.num_experts == 0:
            return
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(f"model.experts_per_token={self.experts_per_token} must be between 1 and "
                              f"model.num_experts={self.num_experts}")
        if self.moe_mlp_dim < 0 or self.num_shared_experts < 0:
            raise ConfigError("model.moe_mlp_dim and model.num_shared_experts must be >= 0")
        if not 0 <= self.first_dense_layers < self.num_layers:
            raise ConfigError(f"model.first_dense_layers={self.first_dense_layers} must be within [0, model.num_layers="
                              f"{self.num_layers}): at least one layer must be MoE")
        after = self.num_layers - self.first_dense_layers
        if self.moe_every < 1 or after % self.moe_every:
            raise ConfigError(f"model.moe_every={self.moe_every} must be >= 1 and divide the {after} layers after "
                              f"model.first_dense_layers={self.first_dense_layers} (groups of moe_every - 1 dense layers "
                              "and one MoE layer)")
        if self.moe_router == "sigmoid" and not self.moe_norm_topk_prob:
            raise ConfigError("model.moe_norm_topk_prob=false is for model.moe_router=softmax; sigmoid routing always "
                              "normalises the chosen scores (set it to true or use softmax)")
        E, groups, chosen = self.num_experts, self.moe_n_group, self.moe_topk_group
        if groups < 1 or E % groups or not 1 <= chosen <= groups:
            raise ConfigError(f"model.moe_n_group={groups} must be >= 1 and divide model.num_experts={E}, and "
                              f"model.moe_topk_group={chosen} lie in [1, moe_n_group]")
        if groups > 1 and self.experts_per_token > chosen * (E // groups):
            raise ConfigError(f"model.experts_per_token={self.experts_per_token} exceeds the {chosen * (E // groups)} "
                              f"experts of model.moe_topk_group={chosen} groups of {E // groups}")
        if groups > 1 and E // groups < 2:
            raise ConfigError(f"model.moe_n_group={groups}: a group is scored by its two best experts, so each group "
                              f"needs at least 2 of the model.num_experts={E}")
        if not self.moe_routed_scaling_factor > 0:
            raise ConfigError(f"model.moe_routed_scaling_factor={self.moe_routed_scaling_factor} must be positive")
        for key in ("moe_aux_loss", "router_z_loss", "router_bias_update_rate"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"config key 'model.{key}' must be >= 0, got {getattr(self, key)}")


# The keys a data.mixture component may set; those it leaves unset come from the data section.
MIXTURE_COMPONENT_KEYS = ("path", "weight", "name", "source", "format", "text_field", "tokens_field", "eval_only")
DataSource = Literal["markov", "tokens", "text", "arrayrecord", "parquet", "hf_datasets"]
FILE_SOURCES = tuple(s for s in typing.get_args(DataSource) if s != "markov")  # the sources read from data.path
TOKENIZED_SOURCES = tuple(s for s in FILE_SOURCES if s != "tokens")  # rows of text, tokenized with data.tokenizer


@dataclasses.dataclass(frozen=True)
class MixtureComponent:
    """One source of a `data.mixture`, with the data section's defaults filled in."""

    name: str
    path: str
    weight: float
    source: str
    format: str
    text_field: str
    tokens_field: Optional[str]
    eval_only: bool


@dataclasses.dataclass(frozen=True)
class MixturePhase:
    """From global step `step` on, the training components' weights (normalised, by component order)."""

    step: int
    weights: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training and held-out data: source, tokenizer, batch shape and order (jaxtrain/data/, docs/data.md)."""

    # markov: synthetic Markov-chain data (no files); tokens: token files; text: .txt/.jsonl tokenized at open.
    # null = not chosen (the config import-hf writes): training refuses until data is named, so an
    # imported model is never fine-tuned on the synthetic Markov chain by accident.
    # arrayrecord / parquet / hf_datasets: records, Parquet files, or Hugging Face `datasets` saved to disk
    # (or their .arrow/.parquet files), each row's text_field tokenized at open or its tokens_field read as ids.
    source: Optional[DataSource] = "markov"
    path: Optional[str] = None  # file, directory or glob, local or gs:// / s3:// (null for markov and mixtures)
    # What a row holds: `text` (documents, packed back to back), `chat` (a `messages` list, rendered with the
    # tokenizer's chat template, loss on the assistant's tokens only) or `prompt_completion` (`prompt` and
    # `completion` strings, loss on the completion).
    format: Literal["text", "chat", "prompt_completion"] = "text"
    # How rows are filled: concat (the stream cut every seq_len tokens; an example may continue in the next row)
    # or first_fit (whole examples placed into rows, the rest padding). null = concat for text, first_fit otherwise.
    packing: Literal["concat", "first_fit", None] = None
    # format chat: a chat template file (.jinja) or a tokenizer directory / tokenizer_config.json that holds one
    # (null = the directory of data.tokenizer).
    chat_template: Optional[str] = None
    tokens_field: Optional[str] = None  # arrayrecord/parquet/hf_datasets: the field of token ids (null: tokenize text_field)
    # A weighted mixture of sources instead of data.path: a list of {path, weight, and optionally name, source,
    # format, text_field, tokens_field, eval_only}; a component's unset keys come from this section.
    mixture: list = dataclasses.field(default_factory=list)
    mixture_unit: Literal["tokens", "documents"] = "tokens"  # what the weights count: tokens, or documents
    # Weights that change during the run: a list of {step, weights: {name: weight}}, steps increasing.
    mixture_schedule: list = dataclasses.field(default_factory=list)
    tokenizer: str = "bytes"  # `bytes` or a path to a Hugging Face tokenizers JSON file
    seq_len: int = 128  # tokens per row; documents are packed into rows (<= model.max_seq_len)
    global_batch_size: int = 8  # sequences per optimizer step, over all processes
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # element type of `tokens` files
    shuffle: bool = True  # shuffle rows with data.seed, a new order every epoch (false: file order)
    seed: int = 0  # seeds the global data order (independent of run.seed)
    prefetch: int = 2  # batches prepared ahead on background threads
    # Processes that tokenize text files not yet in the token cache (null = one per CPU it may use, at most 32; 0 = the
    # opening process). Each file is tokenized once per host and kept under JAXTRAIN_DATA_CACHE.
    tokenize_workers: Optional[int] = None
    eval: Optional[str] = None  # held-out path for the same source (file, directory or glob; null = none)
    eod_id: Optional[int] = None  # end-of-document id: token files without meta.json, or a JSON tokenizer's (null = auto)
    text_field: str = "text"  # text source: the field of each .jsonl line that holds the document
    markov_states: int = 64  # markov source: number of token states (<= model.vocab_size)
    markov_branching: int = 4  # markov source: successors per state
    markov_temperature: float = 1.0  # markov source: softness of transition probabilities

    def validate(self) -> None:
        """The data section's own rules (`data.source: null` passes here: `validate`'s need_data decides)."""
        for key in ("seq_len", "global_batch_size"):
            _require(f"data.{key}", getattr(self, key), getattr(self, key) > 0, "must be positive")
        _require("data.prefetch", self.prefetch + 1, self.prefetch + 1 > 0, "must be positive")
        if self.tokenize_workers is not None:
            _require("data.tokenize_workers", self.tokenize_workers, self.tokenize_workers >= 0, "must be >= 0")
        if self.source == "markov" and not 1 <= self.markov_branching <= self.markov_states:
            raise ConfigError(f"data.markov_branching={self.markov_branching} must be between 1 and data.markov_states")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"data.seed={self.seed} must be within [0, 2**32) (it seeds Grain's index shuffle)")
        if self.source == "markov" and self.eval:  # it would be ignored: the markov source has its own held-out stream
            raise ConfigError(f"data.eval='{self.eval}' is for the tokens and text sources; data.source=markov evaluates "
                              "on its own held-out stream (remove data.eval)")
        if self.mixture:
            if self.path or self.eval:
                raise ConfigError("data.mixture replaces data.path and data.eval (mark held-out components "
                                  "eval_only: true); remove data.path and data.eval")
            self.mixture_phases()  # checks every component and the schedule
        elif self.mixture_schedule:
            raise ConfigError("data.mixture_schedule needs data.mixture")
        elif self.source in FILE_SOURCES and not self.path:
            raise ConfigError(f"data.source={self.source} needs data.path (a file, directory or glob)")
        if self.format != "text" and self.source in ("markov", "tokens"):
            raise ConfigError(f"data.format={self.format} needs rows of text (data.source text, arrayrecord, parquet "
                              f"or hf_datasets), not data.source={self.source}")
        if self.format != "text" and self.tokens_field:
            raise ConfigError(f"data.format={self.format} renders text rows; remove data.tokens_field")

    def mixture_components(self) -> list[MixtureComponent]:
        """`data.mixture` as components with this section's defaults filled in (checked; [] without a mixture)."""
        out: list[MixtureComponent] = []
        sources = FILE_SOURCES
        formats = choices(DataConfig, "format")
        for i, c in enumerate(self.mixture):
            key = f"data.mixture[{i}]"
            if not isinstance(c, dict):
                raise ConfigError(f"{key} must be a mapping with path and weight, got {c!r}")
            unknown = sorted(set(c) - set(MIXTURE_COMPONENT_KEYS))
            if unknown:
                raise ConfigError(f"{key} has unknown key(s) {', '.join(map(str, unknown))} "
                                  f"(known: {', '.join(MIXTURE_COMPONENT_KEYS)})")
            path = c.get("path")
            if not isinstance(path, str) or not path:
                raise ConfigError(f"{key} needs a path (a file, directory or glob)")
            eval_only = c.get("eval_only", False)
            if not isinstance(eval_only, bool):
                raise ConfigError(f"{key}.eval_only must be true or false, got {eval_only!r}")
            weight = c.get("weight", None if not eval_only else 0.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or \
                    (weight <= 0 and not eval_only):
                raise ConfigError(f"{key}.weight must be a positive number, got {weight!r}")
            source = c.get("source", self.source)
            if source not in sources:
                raise not_a_choice(f"{key}.source", source, tuple(sources))
            fmt = c.get("format", self.format)
            if fmt not in formats:
                raise not_a_choice(f"{key}.format", fmt, formats)
            name = c.get("name", Path(path.rstrip("/*")).stem or f"component{i}")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{key}.name must be a non-empty string, got {name!r}")
            text_field, tokens_field = c.get("text_field", self.text_field), c.get("tokens_field", self.tokens_field)
            if not isinstance(text_field, str) or not (tokens_field is None or isinstance(tokens_field, str)):
                raise ConfigError(f"{key}: text_field and tokens_field must be strings")
            if fmt != "text" and source in ("tokens",):
                raise ConfigError(f"{key}: format {fmt} needs rows of text, not source {source}")
            out.append(MixtureComponent(name, path, float(weight), source, fmt, text_field, tokens_field, eval_only))
        names = [c.name for c in out]
        if len(set(names)) != len(names):
            raise ConfigError(f"data.mixture: component names repeat ({', '.join(names)}); set a distinct name for each")
        if self.mixture and not any(not c.eval_only for c in out):
            raise ConfigError("data.mixture has only eval_only components; at least one must be trained on")
        if sum(c.eval_only for c in out) > 1:
            raise ConfigError("data.mixture: at most one component may be eval_only (the held-out set)")
        return out

    def mixture_phases(self) -> list[MixturePhase]:
        """The training weights from step 0 on and at each `data.mixture_schedule` step, normalised."""
        train = [c for c in self.mixture_components() if not c.eval_only]
        names = [c.name for c in train]

        def normalised(weights: list[float]) -> tuple[float, ...]:
            total = sum(weights)
            return tuple(w / total for w in weights)

        phases = [MixturePhase(0, normalised([c.weight for c in train]))]
        for i, entry in enumerate(self.mixture_schedule):
            key = f"data.mixture_schedule[{i}]"
            if not isinstance(entry, dict) or set(entry) != {"step", "weights"}:
                raise ConfigError(f"{key} must be a mapping {{step: N, weights: {{name: weight}}}}, got {entry!r}")
            step, weights = entry["step"], entry["weights"]
            if not isinstance(step, int) or isinstance(step, bool) or step <= phases[-1].step:
                raise ConfigError(f"{key}.step must be an integer above the previous phase's step "
                                  f"({phases[-1].step}), got {step!r}")
            if not isinstance(weights, dict) or set(weights) - set(names):
                raise ConfigError(f"{key}.weights must map training component names ({', '.join(names)}) to weights, "
                                  f"got {weights!r}")
            values = [weights.get(n, 0.0) for n in names]
            if any(isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0
                   for w in values) or sum(values) <= 0:
                raise ConfigError(f"{key}.weights must be non-negative numbers, not all zero, got {weights!r}")
            phases.append(MixturePhase(step, normalised([float(w) for w in values])))
        return phases


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Compute precision and fp16's dynamic loss scaling (jaxtrain/train/precision.py)."""

    policy: Literal["fp32", "bf16", "fp16"] = "fp32"  # compute dtype; parameters and optimizer state stay fp32
    # fp16: the loss scale multiplies the *mean* loss (over the global batch's counted tokens), so
    # these values mean the same at any batch size, sequence length or grad_accum.
    loss_scale_init: float = 32768.0  # fp16: the first loss scale (2**15)
    growth_interval: int = 2000  # fp16: clean steps in a row before the scale grows
    growth_factor: float = 2.0  # fp16: scale *= this after growth_interval clean steps
    backoff_factor: float = 0.5  # fp16: scale *= this after a step with non-finite gradients
    min_loss_scale: float = 1.0  # fp16: the scale never backs off below this

    def validate(self) -> None:
        """The precision section's own rules (the loss scale lives in float32)."""
        _require("precision.loss_scale_init", self.loss_scale_init, 0 < self.loss_scale_init <= FLOAT32_MAX,
                 "must be positive and fit in float32 (<= 3.4e38)")
        _require("precision.growth_interval", self.growth_interval, self.growth_interval > 0, "must be positive")
        _require("precision.growth_factor", self.growth_factor, self.growth_factor > 1, "must be > 1")
        _require("precision.backoff_factor", self.backoff_factor, 0 < self.backoff_factor < 1, "must be within (0, 1)")
        _require("precision.min_loss_scale", self.min_loss_scale, 0 < self.min_loss_scale <= self.loss_scale_init,
                 "must be positive and at most precision.loss_scale_init")


@dataclasses.dataclass(frozen=True)
class StabilityConfig:
    """Spike detection in the step (jaxtrain/train/stability.py), automatic rollback on the host (rollback.py)."""

    guard: bool = True  # skip steps with non-finite gradients and keep spike statistics (false only to measure its cost)
    window: int = 100  # accepted steps the spike statistics span (level, noise, lowest level); also the window for max_spikes
    spike_threshold: float = 6.0  # a spike: the loss this many noise sigmas above its current level (median of 10)...
    min_rise: float = 0.1  # ... and this fraction above it (the gradient norm is reported, never flags alone)
    divergence_rise: float = 0.5  # a loss this fraction above the window's lowest level is a spike whatever the noise
    min_history: Optional[int] = None  # values in the history before any spike is flagged (null = min(20, window))
    skip_spikes: bool = False  # do not apply a spike step's update (decided inside the step)
    rebaseline_after: int = 10  # this many spikes in a row: the statistics restart from the new level
    max_spikes: int = 3  # this many spikes within `window` steps trigger a rollback (0 = never roll back)
    skip_batches: int = 50  # after a rollback, also skip this many batches past the last spike's batch
    max_rollbacks: int = 3  # rollbacks per run; one more stops the run (exit 78, a human is needed) with a message
    z_loss: float = 0.0  # weight of the z-loss, mean(logsumexp(logits)**2), added to the loss (0 = off)

    @property
    def history_needed(self) -> int:
        """`min_history`, or when unset the default that follows `window` (20, at most the window)."""
        return min(20, self.window) if self.min_history is None else self.min_history

    def validate(self) -> None:
        """The stability section's own rules."""
        _require("stability.window", self.window, self.window > 0, "must be positive")
        _require("stability.spike_threshold", self.spike_threshold, self.spike_threshold > 0, "must be positive")
        _require("stability.min_rise", self.min_rise, self.min_rise >= 0, "must be >= 0")
        _require("stability.divergence_rise", self.divergence_rise, self.divergence_rise > 0, "must be positive")
        _require("stability.min_history", self.min_history, self.history_needed >= 2,
                 "must be at least 2 (a spread needs two values)")
        _require("stability.min_history", self.min_history, self.history_needed <= self.window,
                 f"must be at most stability.window ({self.window}): the history holds only that many values")
        _require("stability.rebaseline_after", self.rebaseline_after, self.rebaseline_after >= 1, "must be >= 1")
        for key in ("max_spikes", "skip_batches", "max_rollbacks", "z_loss"):
            _require(f"stability.{key}", getattr(self, key), getattr(self, key) >= 0, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When checkpoints are saved and how many are kept, the node-local tier, the XLA compilation cache
    (jaxtrain/checkpoint/, docs/checkpoint.md)."""

    every_steps: int = 0  # save every N steps (0 = only by time / at the end)
    every_minutes: float = 0.0  # save when this much wall time has passed since the last save
    keep_last: int = 3  # keep the newest N checkpoints
    keep_every: int = 0  # additionally keep every K-th step forever (0 = none)
    async_save: bool = True  # write in the background while training continues
    save_at_end: bool = True  # save when train.steps is reached
    init_from: Optional[str] = None  # start a new run from another run's parameters only (null = fresh init)
    # Persistent XLA cache (null = off). auto: for a job spread over hosts <run.output_dir>/compilation_cache,
    # which every host shares (JAX writes it from process 0 only); for one process or `jaxtrain launch`
    # (one machine) the per-host ~/.cache/jaxtrain/xla, warm across runs.
    compilation_cache_dir: Optional[str] = "auto"
    barrier_timeout_s: float = 300.0  # host barriers fail after this, naming missing processes
    # The local tier (jaxtrain/checkpoint/local_tier.py, docs/checkpoint.md): every N steps each process
    # writes its own shards to node-local storage, replicated to a peer process, and a restart restores
    # the newest step complete on every process when it is newer than the newest persistent checkpoint.
    # 0 = off. Never uploaded; deleted at the end of a run that finished.
    local_every_steps: int = 0
    # Node-local storage (a local SSD or /dev/shm), never the shared run directory. null: a folder per
    # run under the system's temporary directory. Processes keep apart under <local_dir>/process-<index>/;
    # "{process}" in the path becomes the process index: a folder (a disk) for each process.
    local_dir: Optional[str] = None
    local_keep: int = 2  # local steps kept per process (and per replica held)
    local_replicas: int = 1  # peer processes that also keep each process's shards (0: none; on 1 process: none)
    # How a replica reaches its holder: "auto" writes into the holder's folder when it is this process's
    # too (same host, same local_dir) and sends it over TCP otherwise (private disks); "files" always
    # writes (local_dir on storage every host sees); "network" always sends.
    local_transfer: Literal["auto", "files", "network"] = "auto"
    # What a local save blocks on: "device" dispatches an on-device copy of the state and returns (the
    # writer thread reads the copy to the host; one more state share of device memory meanwhile);
    # "host" waits for the step and copies to the host on the loop thread; "auto": device on the CPU
    # (its device memory is host memory), host on accelerators, where that memory is scarce.
    local_snapshot: Literal["auto", "device", "host"] = "auto"

    def validate(self) -> None:
        """The checkpoint section's own rules (the local tier's folder against run.output_dir is a
        cross-section check)."""
        for key in ("every_steps", "every_minutes", "keep_last", "keep_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"checkpoint.{key} must be >= 0, got {getattr(self, key)}")
        if self.keep_last == 0:  # retention never deletes the newest good checkpoint: 0 would silently keep one
            raise ConfigError("checkpoint.keep_last=0 is not supported: the newest good checkpoint is always kept; "
                              "use keep_last >= 1")
        if self.barrier_timeout_s <= 0:
            raise ConfigError(f"checkpoint.barrier_timeout_s must be positive, got {self.barrier_timeout_s}")
        if self.local_every_steps < 0 or self.local_replicas < 0 or self.local_keep < 1:
            raise ConfigError("checkpoint.local_every_steps and checkpoint.local_replicas must be >= 0 and "
                              f"checkpoint.local_keep >= 1, got {self.local_every_steps}, {self.local_replicas}, "
                              f"{self.local_keep}")
        if self.local_every_steps > 0 and self.local_dir is not None and "://" in self.local_dir:
            raise ConfigError(f"checkpoint.local_dir='{self.local_dir}' must be a node-local path (a local SSD or "
                              "/dev/shm), not a URL: the local tier is never uploaded")


@dataclasses.dataclass(frozen=True)
class FaultConfig:
    """Noticing failures: hang watchdog, stragglers, preflight health check (jaxtrain/fault/watchdog.py,
    stragglers.py, preflight.py)."""

    # No step finished for this long -> stacks dumped, `hang` event, exit 75. 0 = off: the step deadline
    # only; the start-up, compile and checkpoint deadlines below still hold (docs/fault.md).
    hang_timeout_s: float = 600.0
    # Deadline for start-up: distributed init, the first compile and step (must be positive, no "off").
    # An XLA compile in progress gets max(this, 3 x the run's longest recorded compile), or
    # this x 2^attempt (at most x16) when none is recorded (jaxtrain/fault/watchdog.py).
    startup_timeout_s: float = 1800.0
    checkpoint_timeout_s: float = 1800.0  # deadline for one checkpoint save or restore call (positive, no "off")
    straggler_every: int = 50  # steps between cross-process comparisons of host step times (0 = off)
    straggler_factor: float = 1.5  # a process this many times slower than the median is a straggler
    preflight: bool = True  # health check before training on multi-process jobs (always via `jaxtrain preflight`)
    preflight_factor: float = 0.7  # a process or link below this fraction of the median is named
    preflight_action: Literal["warn", "exit"] = "warn"  # exit: a named process stops the job with exit 75
    # Host callbacks at the start and end of each compiled step time-stamp how far each process's
    # devices got, so a hang is blamed on the process whose device or host stopped
    # (jaxtrain/fault/step_marks.py). auto: multi-process jobs on GPU/TPU (on the CPU they make the
    # dispatch wait for the step); always: every multi-process job; never: blame by beats and heartbeats.
    step_markers: Literal["auto", "always", "never"] = "auto"
    # Every N steps each process checks host memory, the run directory's disk and its own step time
    # against their running median: a `health` event and jaxtrain_health_* metrics (0 = off; docs/monitoring.md).
    health_every_steps: int = 0
    # The health check's GPU counters from NVML (ECC errors, row remaps, hardware throttling;
    # observe/nvml.py, needs nvidia-ml-py). auto: when the devices are GPUs; always: whenever NVML
    # answers (a CPU job on a GPU node); never: off.
    health_nvml: Literal["auto", "always", "never"] = "auto"

    def validate(self) -> None:
        """The fault section's own rules."""
        _require("fault.hang_timeout_s", self.hang_timeout_s, self.hang_timeout_s >= 0, "must be >= 0 (0 = off)")
        _require("fault.startup_timeout_s", self.startup_timeout_s, self.startup_timeout_s > 0, "must be positive")
        _require("fault.checkpoint_timeout_s", self.checkpoint_timeout_s, self.checkpoint_timeout_s > 0,
                 "must be positive")
        _require("fault.straggler_every", self.straggler_every, self.straggler_every >= 0, "must be >= 0 (0 = off)")
        _require("fault.health_every_steps", self.health_every_steps, self.health_every_steps >= 0,
                 "must be >= 0 (0 = off)")
        _require("fault.straggler_factor", self.straggler_factor, self.straggler_factor > 1, "must be > 1")
        _require("fault.preflight_factor", self.preflight_factor, 0 < self.preflight_factor < 1,
                 "must be within (0, 1)")


@dataclasses.dataclass(frozen=True)
class ObserveConfig:
    """Live monitoring (jaxtrain/observe/prometheus.py, docs/monitoring.md)."""

    # Serve Prometheus metrics on http://<host>:<port + local index>/metrics from every process
    # (0 = off; the cluster presets use 9400). Processes sharing a machine take consecutive ports.
    prometheus_port: int = 0
    prometheus_addr: str = "0.0.0.0"  # the address the endpoint binds (127.0.0.1: this machine only)
    # Also write the metrics atomically to this .prom file for node_exporter's textfile collector
    # ({process} in the path: the process index; else -p<index> is added for multi-process jobs). null = no file.
    prometheus_textfile: Optional[str] = None

    def validate(self) -> None:
        """The observe section's own rules."""
        if not 0 <= self.prometheus_port <= 65535:
            raise ConfigError(f"config key 'observe.prometheus_port' must be a TCP port within [0, 65535] (0 = off), "
                              f"got {self.prometheus_port}")
        if self.prometheus_textfile is not None and not self.prometheus_textfile.endswith(".prom"):
            raise ConfigError(f"config key 'observe.prometheus_textfile' must end in .prom (node_exporter's textfile "
                              f"collector reads only those), got '{self.prometheus_textfile}'")


@dataclasses.dataclass(frozen=True)
class ChaosConfig:
    """Fault injection for tests and drills; all off by default."""

    kill_at_step: int = -1  # SIGKILL a process right after this step completes
    kill_process: int = 0  # which process kill_at_step kills
    slow_process: int = 0  # which process slow_seconds and start_delay_s delay
    slow_seconds: float = 0.0  # that process sleeps this long after every step (a straggler drill)
    start_delay_s: float = 0.0  # that process sleeps this long before joining the run's first collectives
    # Numerics drills, keyed by the batch that step N of an uninterrupted run draws: like real bad
    # data, a rollback that skips those batches leaves them behind.
    nan_at_steps: list = dataclasses.field(default_factory=list)  # those batches give non-finite gradients
    spike_at_steps: list = dataclasses.field(default_factory=list)  # those batches' loss and gradients x spike_factor
    spike_factor: float = 100.0  # what spike_at_steps multiplies the loss and gradients by
    corrupt_at_steps: list = dataclasses.field(default_factory=list)  # those batches' tokens replaced by random ids
    hang_at_step: int = -1  # hang_process stops making progress right after this step (first attempt only)
    hang_process: int = 0  # which process hang_at_step hangs
    hang_in_step: bool = False  # ... instead blocks INSIDE step hang_at_step (a host callback): peers wait in its collectives
    hang_freeze: bool = False  # ... instead stops itself with SIGSTOP after that step (no heartbeat either)
    # A Python error in the loop: raise_process raises a RuntimeError right after this step (first attempt only).
    raise_at_step: int = -1
    raise_process: int = 0  # which process raise_at_step raises in
    raise_every_attempt: bool = False  # raise_at_step fires on every attempt (a deterministic bug), not the first only
    # A bad node: unlike the drills above, this one fires on EVERY attempt, so only isolating the slot
    # (`jaxtrain launch --isolate-after K`) lets the run finish. The slot is JAXTRAIN_SLOT under
    # `jaxtrain launch` (kept when other slots are isolated), else the process index.
    crash_process: int = -1  # the slot that crashes (exit 1) on every attempt (-1 = none)
    crash_at_step: int = 0  # 0: at start-up, before the first step; N: right after the first step >= N an attempt runs
    # Bad links: the preflight exchanges of these process pairs take slow_link_seconds longer. One pair
    # [i, j], or several [[i, j], ...] (a bad network card: every pair touching one process).
    slow_link: list = dataclasses.field(default_factory=list)
    slow_link_seconds: float = 0.0  # extra seconds each preflight exchange of a slow_link pair takes

    def slow_link_pairs(self) -> list[tuple[int, int]]:
        """`slow_link` as (i, j) pairs: [i, j] is one pair, [[i, j], ...] several."""
        links = self.slow_link
        if not links:
            return []
        return [tuple(p) for p in (links if isinstance(links[0], list) else [links])]

    def slow_link_ends(self) -> dict[str, int]:
        """Every process `slow_link` names, by where it is written (`chaos.slow_link[1]` of one pair,
        `chaos.slow_link[2][0]` of a list of pairs): for checking them against the job's size."""
        links = self.slow_link
        if links and isinstance(links[0], list):
            return {f"chaos.slow_link[{k}][{e}]": p for k, pair in enumerate(links) for e, p in enumerate(pair)}
        return {f"chaos.slow_link[{k}]": p for k, p in enumerate(links)}

    def validate(self) -> None:
        """The drills' own rules, from the text alone (the drills: jaxtrain/fault/chaos.py). Whether the
        processes they name exist is `validate_processes`, once the job's size is known."""
        _require("chaos.spike_factor", self.spike_factor, self.spike_factor > 0, "must be positive")
        for key in ("nan_at_steps", "spike_at_steps", "corrupt_at_steps"):
            steps = getattr(self, key)
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in steps):
                raise ConfigError(f"config key 'chaos.{key}' must be a list of step numbers >= 1, got {steps!r}")
        for key in ("slow_seconds", "start_delay_s", "slow_link_seconds", "kill_process", "slow_process",
                    "crash_at_step", "raise_process"):
            _require(f"chaos.{key}", getattr(self, key), getattr(self, key) >= 0, "must be >= 0")
        links = ([self.slow_link] if self.slow_link and not isinstance(self.slow_link[0], list)
                 else self.slow_link)
        if not all(isinstance(p, list) and len(p) == 2 and p[0] != p[1]
                   and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p) for p in links):
            raise ConfigError(f"config key 'chaos.slow_link' must be two different process indices [i, j], "
                              f"or a list of such pairs [[i, j], ...]; got {self.slow_link!r}")
        if self.crash_process < -1:
            raise ConfigError(f"config key 'chaos.crash_process' must be a slot number >= 0 or -1 (none), "
                              f"got {self.crash_process}")
        if self.hang_in_step and self.hang_freeze:
            raise ConfigError("config keys 'chaos.hang_in_step' and 'chaos.hang_freeze' are two ways to hang: set "
                              "one, not both")

    def validate_processes(self, num_processes: int, under_launcher: bool = False) -> None:
        """Every drill that is on names a process of a job of `num_processes` (a device-time check:
        `jaxtrain.parallel.mesh_shape.validate_against_devices` calls it). `under_launcher`: the
        processes run in `jaxtrain launch` slots, and `crash_process` names a slot (maybe an isolated one)."""
        drills = {"chaos.kill_process": (self.kill_process, self.kill_at_step >= 0),
                  "chaos.slow_process": (self.slow_process, self.slow_seconds > 0 or self.start_delay_s > 0),
                  "chaos.hang_process": (self.hang_process, self.hang_at_step >= 0),
                  "chaos.raise_process": (self.raise_process, self.raise_at_step >= 0),
                  **{key: (p, True) for key, p in self.slow_link_ends().items()}}
        if not under_launcher:  # under `jaxtrain launch` it is a slot, which may be an isolated one
            drills["chaos.crash_process"] = (self.crash_process, self.crash_process >= 0)
        for key, (process, enabled) in drills.items():
            if enabled and not 0 <= process < num_processes:
                raise ConfigError(f"{key}={process} names no process of this job: it has {num_processes} "
                                  f"process(es), numbered 0 to {num_processes - 1}")


@dataclasses.dataclass(frozen=True)
class Config:
    run: RunConfig = RunConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()
    pipeline: PipelineConfig = PipelineConfig()
    context: ContextConfig = ContextConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    precision: PrecisionConfig = PrecisionConfig()
    stability: StabilityConfig = StabilityConfig()
    fault: FaultConfig = FaultConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    chaos: ChaosConfig = ChaosConfig()
    observe: ObserveConfig = ObserveConfig()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def with_overrides(self, *overrides: str) -> "Config":
        """A copy with `dotted.key=value` overrides applied and validated again."""
        return from_dict(apply_overrides(self.to_dict(), list(overrides)))

    def validate(self, *, need_data: bool = True) -> None:
        """Phase 1 (the module's `validate`): every section's own rules, then the cross-section ones."""
        validate(self, need_data=need_data)


# ----------------------------------------------------------------------------- parsing


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every valid dotted key, e.g. 'model.d_model'."""
    keys = []
    for f in dataclasses.fields(cls):
        ftype = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(ftype):
            keys += all_keys(ftype, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


# Names other trainers (and people) use for our keys, by the typed key's last part: spelling
# similarity alone would suggest `optim.b2` for `optim.lr`.
KEY_ALIASES: dict[str, str] = {
    "lr": "optim.learning_rate", "learning_rate": "optim.learning_rate", "wd": "optim.weight_decay",
    "warmup": "optim.warmup_steps", "clip": "optim.grad_clip_norm", "grad_clip": "optim.grad_clip_norm",
    "max_grad_norm": "optim.grad_clip_norm", "clip_grad_norm": "optim.grad_clip_norm",
    "bs": "data.global_batch_size", "batch_size": "data.global_batch_size",
    "global_batch_size": "data.global_batch_size", "seq_length": "data.seq_len", "sequence_length": "data.seq_len",
    "n_layers": "model.num_layers", "num_hidden_layers": "model.num_layers", "depth": "model.num_layers",
    "n_heads": "model.num_heads", "num_attention_heads": "model.num_heads",
    "n_kv_heads": "model.num_kv_heads", "num_key_value_heads": "model.num_kv_heads",
    "hidden_size": "model.d_model", "dim": "model.d_model", "intermediate_size": "model.mlp_dim",
    "ffn_dim": "model.mlp_dim", "vocab": "model.vocab_size",
    "max_steps": "train.steps", "num_steps": "train.steps", "total_steps": "train.steps",
    "gradient_accumulation_steps": "train.grad_accum", "grad_accum_steps": "train.grad_accum",
    "save_every": "checkpoint.every_steps", "checkpoint_every": "checkpoint.every_steps",
    "out_dir": "run.output_dir", "output": "run.output_dir",
}


def _abbreviates(short: str, name: str) -> bool:
    """Whether `short` is `name`'s letters in order from its first (lr -> learning_rate, eval_evry -> eval_every)."""
    if not short or not name or short[0] != name[0]:
        return False
    rest = iter(name)
    return all(ch in rest for ch in short)  # `in` on an iterator consumes it: an in-order subsequence test


def suggest_key(key: str) -> Optional[str]:
    """The valid key a user most likely meant by the unknown `key`, or None.

    In order: a known alias of its last part (`lr`, `bs`); the one key of its section whose last part it
    abbreviates; the closest whole key by spelling; a key of another section with the same last part.
    """
    keys = all_keys()
    section, _, last = key.rpartition(".")
    alias = KEY_ALIASES.get(last)
    if alias in keys:
        return alias
    abbreviated = [k for k in keys if k.startswith(section + ".") and _abbreviates(last, k.rpartition(".")[2])]
    if len(abbreviated) == 1:  # several (optim.b -> b1, b2) say nothing
        return abbreviated[0]
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not close:  # a misspelled section: suggest by the last part
        close = [k for k in keys if k.endswith("." + last)][:1]
    return close[0] if close else None


def _unknown_key(key: str) -> ConfigError:
    close = suggest_key(key)
    hint = f"; did you mean '{close}'?" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def _coerce(key: str, value: Any, t: Any) -> Any:
    """Check `value` against type `t`; return it (ints widen to float). Raise ConfigError."""
    origin = typing.get_origin(t)
    allowed = literal_choices(t)  # Literal[...], or Optional[Literal[...]]: one message naming every choice
    if allowed is not None and origin is not Literal:
        if value not in allowed:
            raise not_a_choice(key, value, allowed)
        return value
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(t)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError:
                pass
        raise ConfigError(f"config key '{key}' expects {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(t)
        if value not in allowed:
            raise not_a_choice(key, value, allowed)
        return value
    if t is bool:
        if isinstance(value, bool):
            return value
    elif t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif t is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string; accept it as a float
            try:
                return float(value)
            except ValueError:
                pass
    elif t is str:
        if isinstance(value, str):
            return value
    elif t is dict or origin is dict:
        if isinstance(value, dict):
            return value
    elif t is list or origin is list:
        if isinstance(value, list):
            return value
    else:
        raise TypeError(f"unsupported config type {t} for {key}")
    raise ConfigError(f"config key '{key}' expects {_type_name(t)}, got {value!r} ({type(value).__name__})")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.')}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            raise _unknown_key(prefix + str(k))
    kwargs = {}
    for name, value in data.items():
        t = hints[name]
        if dataclasses.is_dataclass(t):
            kwargs[name] = _build(t, value if value is not None else {}, prefix + name + ".")
        else:
            kwargs[name] = _coerce(prefix + name, value, t)
            default = fields[name].default_factory
            if isinstance(kwargs[name], dict) and default is not dataclasses.MISSING:
                # A mapping (mesh.rules) overrides entries of its defaults; it does not replace them all.
                kwargs[name] = {**default(), **kwargs[name]}
    return cls(**kwargs)


def from_dict(data: dict, *, need_data: bool = True) -> Config:
    """Build and phase-1-validate a Config from a nested dict (`need_data`: see `validate`)."""
    cfg = _build(Config, data or {}, "")
    validate(cfg, need_data=need_data)
    return cfg


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`data` (a config as nested dicts) with `dotted.key=value` overrides set; values parse as YAML.

    Raises:
      ConfigError: an override without `=`, or an unknown key (the nearest known one suggested).
    """
    valid = set(all_keys())
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form section.key=value (e.g. train.steps=10)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key not in valid:
            raise _unknown_key(key)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': value is not valid YAML ({e.__class__.__name__})") from None
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[leaf] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                need_data: bool = True) -> Config:
    """Read a YAML config (optional) and apply `dotted.key=value` overrides.

    Args:
      path: YAML file; None starts from the defaults.
      overrides: strings like 'train.steps=20' or 'model.attention=xla'. Values parse as YAML.
      need_data: False accepts `data.source: null` (an import-hf config read for its model only).
    Returns:
      A frozen, phase-1-validated Config.
    Raises:
      ConfigError: missing file, bad YAML, unknown key, wrong type or invalid combination.
    """
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{path}' is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections")
    return from_dict(apply_overrides(data, list(overrides)), need_data=need_data)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ----------------------------------------------------------------------------- validation


# One line, for `jaxtrain train` (and everything that loads a config to train) on an imported config.
DATA_NOT_CHOSEN = ("data.source is not chosen (null, as import-hf writes it): set data.source=text data.path=FILES "
                   "(.txt/.jsonl), data.source=tokens data.path=DIR (from jaxtrain prepare-data), or data.source=markov "
                   "to train on the synthetic Markov chain on purpose")


def logical_axis_names() -> list[str]:
    """Every logical axis name the model uses: the keys of the default rules table, plus 'norm'
    (norm scales, always replicated)."""
    return sorted(set(MeshConfig().rules) | {"norm"})


def validate(cfg: Config, *, need_data: bool = True) -> None:
    """Phase 1: rules that need no devices. Raises ConfigError naming the keys involved.

    In order: whether data is chosen; for every section, the checks all sections share
    (`check_field_values`) and then its own `validate()`; last the rules that span sections
    (`validate_cross_section`). Phase 2, what needs the device and process counts, is
    `jaxtrain.parallel.mesh_shape.validate_against_devices`.

    `need_data=False` accepts a config whose data is not chosen yet (`data.source: null`, as
    import-hf writes it) for readers that need only the model (export-hf).
    """
    if cfg.data.source is None and need_data:
        raise ConfigError(DATA_NOT_CHOSEN)
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        check_field_values(f.name, section)
        section.validate()
    validate_cross_section(cfg)


@functools.cache
def _field_types(section: type) -> dict[str, Any]:
    return typing.get_type_hints(section)


def check_field_values(name: str, section: Any) -> None:
    """The checks every section shares: each float finite (inf would e.g. skip every fp16 step), each
    Literal-typed field one of its values (the loader checks those too, but a section built in Python
    is not loaded). `name`: the section's key in Config."""
    types_ = _field_types(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config key '{name}.{f.name}' must be a finite number, got {value}")
        allowed = literal_choices(types_[f.name])
        if allowed is not None and value not in allowed:
            raise not_a_choice(f"{name}.{f.name}", value, allowed)


def validate_cross_section(cfg: Config) -> None:
    """Phase-1 rules that involve keys of more than one section (each section's own rules ran first)."""
    m, d, t = cfg.model, cfg.data, cfg.train
    # model x mesh
    if m.num_experts == 0 and cfg.mesh.expert > 1:
        raise ConfigError(f"mesh.expert={cfg.mesh.expert} needs a mixture of experts (model.num_experts > 0)")
    # data x model, data x train
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len={d.seq_len} is larger than model.max_seq_len={m.max_seq_len}")
    if d.global_batch_size % t.grad_accum:
        raise ConfigError(
            f"data.global_batch_size={d.global_batch_size} is not divisible by train.grad_accum={t.grad_accum}")
    if d.source == "markov" and not 2 <= d.markov_states <= m.vocab_size:
        raise ConfigError(
            f"data.markov_states={d.markov_states} must be between 2 and model.vocab_size={m.vocab_size}")
    if d.eod_id is not None and not 0 <= d.eod_id < m.vocab_size:
        raise ConfigError(f"data.eod_id={d.eod_id} must be within [0, model.vocab_size={m.vocab_size})")
    if d.source in TOKENIZED_SOURCES and d.tokenizer == "bytes" and m.vocab_size < 257:
        raise ConfigError(f"data.tokenizer=bytes needs model.vocab_size >= 257 (256 byte values + the "
                          f"end-of-document id 256), got {m.vocab_size}")
    # mesh x pipeline / context x model, data, train (a -1 axis is checked in phase 2, once its size is known)
    if cfg.mesh.stage > 1:
        validate_pipeline(cfg, cfg.mesh.stage)
    if cfg.mesh.context > 1:
        validate_context(cfg, cfg.mesh.context)
    # chaos x fault
    if cfg.chaos.hang_in_step and cfg.fault.step_markers == "never":
        raise ConfigError("config key 'chaos.hang_in_step' blocks inside the step's start mark, a host callback that "
                          "fault.step_markers=never leaves out: set fault.step_markers=auto")
    # optim x train: a WSD decay must fit the schedule after its warmup (the default, a fifth, always does)
    o = cfg.optim
    length = o.decay_steps if o.decay_steps is not None else t.steps
    if o.schedule == "wsd" and o.wsd_decay_steps > 0 and o.warmup_steps + o.wsd_decay_steps > length:
        raise ConfigError(f"optim.wsd_decay_steps={o.wsd_decay_steps} after optim.warmup_steps={o.warmup_steps} is "
                          f"longer than the schedule's {length} steps (optim.decay_steps, else train.steps)")
    # checkpoint x run
    c = cfg.checkpoint
    if c.local_every_steps > 0 and c.local_dir is not None and "://" not in cfg.run.output_dir:
        local, run = Path(c.local_dir.replace("{process}", "0")).resolve(), Path(cfg.run.output_dir).resolve()
        if local == run or run in local.parents:
            raise ConfigError(f"checkpoint.local_dir='{c.local_dir}' is inside run.output_dir: the local tier "
                              "belongs on node-local storage, not in the shared run directory")


def validate_pipeline(cfg: Config, stages: int) -> None:
    """Pipeline rules for `stages` pipeline stages (phase 1 for a given mesh.stage; phase 2 again
    once mesh.stage=-1 is resolved). No-op for one stage. Raises ConfigError with the numbers."""
    if stages == 1:
        return
    p, m = cfg.pipeline, cfg.model
    layers = cfg.mesh.rules.get("layers")
    if (layers if isinstance(layers, list) else [layers]) != ["stage"]:
        raise ConfigError(f"mesh.stage={stages} needs mesh.rules['layers'] = stage (pipeline stages split the stacked "
                          f"layers), got {layers!r}")
    if m.mixed_windows:
        raise ConfigError(f"model.sliding_window_pattern={m.sliding_window_pattern} with mesh.stage={stages}: local and "
                          "global layers inside pipeline stages are not built yet; use mesh.stage=1 or a window in "
                          "every layer (sliding_window_pattern=0)")
    if m.mtp_depth > 0:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with mesh.stage={stages}: multi-token prediction after a "
                          "pipeline's last stage is not built; use mesh.stage=1 or model.mtp_depth=0")
    groups = stages * p.repeats
    # What the stages split: the layers, or a mixture of experts' units (one MoE layer with its
    # moe_every - 1 dense layers; the first dense layers run before the pipeline).
    units, what = ((m.num_moe_layers, f"the {m.num_moe_layers} MoE layers (each with its moe_every - 1 = "
                    f"{m.moe_every - 1} dense layers)") if m.num_experts > 0 else
                   (m.num_layers, f"model.num_layers={m.num_layers}"))
    if units % groups:
        raise ConfigError(f"{what} is not divisible by mesh.stage={stages} x pipeline.repeats={p.repeats} = {groups} "
                          "layer groups; pick a stage count and repeats whose product divides it")
    if p.microbatches < stages:
        raise ConfigError(f"pipeline.microbatches={p.microbatches} is less than mesh.stage={stages}: every stage needs a "
                          f"microbatch of its own; use at least {stages} (the bubble (S-1)/(R*M+S-1) shrinks as M grows)")
    per_step = cfg.data.global_batch_size // cfg.train.grad_accum
    if per_step % p.microbatches:
        raise ConfigError(f"data.global_batch_size={cfg.data.global_batch_size} / train.grad_accum={cfg.train.grad_accum} "
                          f"= {per_step} sequences per step do not split into pipeline.microbatches={p.microbatches}")


def validate_context(cfg: Config, context: int) -> None:
    """Context-parallel rules for a `context`-way split sequence (phase 1 for a given mesh.context;
    phase 2 again once a -1 axis is resolved). Raises ConfigError."""
    if context <= 1:
        return
    if cfg.model.sliding_window > 0:
        raise ConfigError(f"model.sliding_window={cfg.model.sliding_window} with mesh.context={context}: the context "
                          "ring cannot skip the hops outside a window yet; use mesh.context=1")
    if cfg.model.attention_sinks:
        raise ConfigError(f"model.attention_sinks=true with mesh.context={context}: the context blocks do not "
                          "combine a sink logit yet; use mesh.context=1")
    order, seq = cfg.context.order, cfg.data.seq_len
    chunks = 2 * context if order == "zigzag" else context
    if seq % chunks:
        raise ConfigError(f"data.seq_len={seq} is not divisible by {chunks} (context.order={order} with "
                          f"mesh.context={context} cuts each sequence into {chunks} equal chunks)")
    if cfg.mesh.stage != 1:
        raise ConfigError(f"mesh.context={context} with mesh.stage={cfg.mesh.stage}: context parallelism inside "
                          "pipeline stages is not built yet; use mesh.stage=1 or mesh.context=1")
    length = cfg.mesh.rules.get("length")
    if "context" not in (length if isinstance(length, list) else [length]):
        raise ConfigError(f"mesh.context={context} needs mesh.rules['length'] to include context (got {length!r})")
    if cfg.model.num_experts > 0:
        raise ConfigError(f"mesh.context={context} with model.num_experts={cfg.model.num_experts}: a mixture of "
                          "experts over a split sequence is not built yet; use mesh.context=1 with MoE")
