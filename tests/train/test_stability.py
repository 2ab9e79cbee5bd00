"""Mixed precision that cannot ruin a run: policies, fp16 loss scaling, the in-step guard, spike
detection and automatic rollback (jaxtrain/train/precision.py, jaxtrain/train/stability.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TINY, read_jsonl
from jax.extend import core as jax_core
from trees import assert_trees_equal, named_leaves

from jaxtrain.checkpoint.checkpointer import Checkpointer
from jaxtrain.checkpoint.layout import list_checkpoints
from jaxtrain.checkpoint.layout import MARKER
from jaxtrain.config import ConfigError, load_config
from jaxtrain.model.llama import Transformer
from jaxtrain.train.optim import learning_rate_schedule
from jaxtrain.train.precision import compute_dtype
from jaxtrain.train.step import loss_sum
from jaxtrain.trainer import Trainer

SMALL = ["model.num_layers=1", "data.global_batch_size=8", "data.seq_len=32", "checkpoint.compilation_cache_dir=null"]


def trainer(tmp_path, *overrides, devices=1, write_files=False) -> Trainer:
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", *SMALL, *overrides])
    return Trainer(cfg, write_files=write_files, devices=jax.devices()[:devices])


def host(tree):
    return jax.tree_util.tree_map(lambda x: np.array(x), jax.device_get(tree))  # writable copies


# ----------------------------------------------------------------------------- policies


def test_bf16_keeps_fp32_parameters_and_optimizer_state_and_follows_fp32(tmp_path):
    """bf16 compute, fp32 master weights: the loss curve stays within 2% of fp32's over 40 steps."""
    curves = {}
    for policy in ("fp32", "bf16"):
        t = trainer(tmp_path, f"precision.policy={policy}", "train.steps=40")
        curves[policy] = np.array([t.step()["loss"] for _ in range(40)])
        dtypes = {x.dtype for x in jax.tree_util.tree_leaves((t.state["params"], t.state["opt_state"]))
                  if jnp.issubdtype(x.dtype, jnp.floating)}
        assert dtypes == {jnp.dtype(jnp.float32)}, (policy, dtypes)
    assert curves["fp32"][0] - curves["fp32"][-1] > 1.0  # both really trained
    np.testing.assert_allclose(curves["bf16"], curves["fp32"], rtol=0.02)
    assert not np.array_equal(curves["bf16"], curves["fp32"])  # and bf16 really computed in bf16


def equations(jaxpr: jax_core.Jaxpr) -> list[jax_core.JaxprEqn]:
    """Every equation of a jaxpr, those nested in scans, jits and custom-gradient calls included."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax_core.ClosedJaxpr):
                    out += equations(sub.jaxpr)
                elif isinstance(sub, jax_core.Jaxpr):
                    out += equations(sub)
    return out


def test_bf16_computes_norms_softmax_logits_and_loss_in_fp32():
    """Read off the loss function's jaxpr under bf16: the layers' matmuls run in bf16, while every
    reduction and transcendental (RMSNorm's mean and rsqrt, the attention softmax, the loss's
    logsumexp) runs in fp32, and the two matmuls that feed a softmax (attention scores and logits)
    take bf16 operands but produce fp32."""
    V, L = 72, 32  # a vocab size no other dimension has: a matmul whose output ends in V makes logits
    cfg = load_config(TINY, [*SMALL, "precision.policy=bf16", f"model.vocab_size={V}"])
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0), dtype=compute_dtype(cfg)))
    graphdef, params = nnx.split(abstract)
    batch = {k: jax.ShapeDtypeStruct((8, L), jnp.int32) for k in ("tokens", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = jax.ShapeDtypeStruct((8, L), jnp.float32)
    closed = jax.make_jaxpr(lambda p, b: loss_sum(p, graphdef, b))(nnx.to_pure_dict(params), batch)
    eqns = equations(closed.jaxpr)
    f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)

    fp32_ops = ("rsqrt", "exp", "log", "reduce_max", "reduce_sum")
    assert {e.primitive.name for e in eqns} >= set(fp32_ops)
    for e in eqns:
        if e.primitive.name in fp32_ops:
            assert {v.aval.dtype for v in (*e.invars, *e.outvars)} == {f32}, e
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert all({v.aval.dtype for v in e.invars} == {bf16} for e in dots)  # every matmul runs in bf16 ...
    assert any(e.outvars[0].aval.dtype == bf16 for e in dots)  # ... the projections of the layers in bf16 out ...
    softmax_inputs = [e for e in dots if e.outvars[0].aval.shape[-1] in (V, L)]  # ... logits, attention scores ...
    assert {e.outvars[0].aval.shape[-1] for e in softmax_inputs} == {V, L}
    assert all(e.outvars[0].aval.dtype == f32 for e in softmax_inputs)  # ... come out in fp32
    assert [v.aval.dtype for v in closed.jaxpr.outvars] == [f32] * 4  # objective, cross-entropy, z-loss, tokens


def test_fp16_scale_backs_off_on_overflow_and_grows_after_clean_steps(tmp_path):
    t = trainer(tmp_path, "precision.policy=fp16", "precision.loss_scale_init=64", "precision.growth_interval=4",
                "chaos.nan_at_steps=[3]", "train.steps=12")
    records = [t.step() for _ in range(12)]
    scales = [r["loss_scale"] for r in records]  # the scale each step used
    assert scales[:3] == [64, 64, 64] and records[2]["skipped"]  # step 3: overflow -> skipped ...
    assert scales[3:7] == [32, 32, 32, 32]  # ... scale halved; 4 clean steps later ...
    assert scales[7] == 64 and not any(r["skipped"] for r in records[3:])  # ... grown back
    assert records[-1]["skipped_steps"] == 1


@pytest.mark.slow
def test_fp16_with_injected_overflows_ends_within_2_percent_of_fp32(tmp_path):
    """configs/tiny.yaml to the end: fp16 with dynamic scaling and three injected overflows."""
    finals = {}
    for policy, extra in (("fp32", []), ("fp16", ["chaos.nan_at_steps=[50,51,200]"])):
        cfg = load_config(TINY, [f"run.output_dir={tmp_path / policy}", "checkpoint.compilation_cache_dir=null",
                                 f"precision.policy={policy}", "train.log_every=1", *extra])
        console = io.StringIO()
        t = Trainer(cfg, console=console, devices=jax.devices()[:1])
        t.fit()
        t.close()
        metrics = read_jsonl(tmp_path / policy / "metrics.jsonl")
        finals[policy] = np.mean([m["loss"] for m in metrics[-3:]])
        if policy == "fp16":
            skipped = {m["step"] for m in metrics if m["skipped"]}
            assert {50, 51, 200} <= skipped
            events = read_jsonl(tmp_path / policy / "events.jsonl")
            drills = [(e["step"], e["drill"]) for e in events if e["kind"] == "chaos"]
            assert drills == [(50, "nan"), (51, "nan"), (200, "nan")]
            assert {e["step"] for e in events if e["kind"] == "nonfinite_skipped"} == skipped  # overflows too
            done = events[-1]
            assert done["kind"] == "done" and done["skipped_steps"] == len(skipped)
            last_line = [line for line in console.getvalue().splitlines() if line.startswith("step ")][-1]
            assert last_line.endswith(f"  skipped {len(skipped)}"), last_line
    assert abs(finals["fp16"] - finals["fp32"]) <= 0.02 * finals["fp32"], finals


# ----------------------------------------------------------------------------- the guard


def test_nonfinite_step_keeps_state_and_statistics_and_causes_no_false_spikes(tmp_path):
    t = trainer(tmp_path, "chaos.nan_at_steps=[30]", "stability.min_history=10", "stability.window=10",
                "stability.spike_threshold=4", "train.steps=45")
    for _ in range(29):
        t.step()
    before = host(t.state)
    record = t.step()  # step 30: NaN gradients
    after = host(t.state)
    assert record["skipped"] and np.isnan(record["loss"])
    for part in ("params", "opt_state", "stability", "loss_scale"):
        if part == "stability":  # only the skip counter moves; the running statistics are untouched
            before[part]["skipped_steps"] += 1
        assert_trees_equal(after[part], before[part], what=f"{part} ")
    assert after["step"] == before["step"] + 1
    flagged = [t.step() for _ in range(15)]
    assert not any(r["spike"] or r["skipped"] for r in flagged)  # one NaN poisons nothing after it
    # The learning rate reported is the one the update used: the schedule at the optimizer's own count,
    # which the skipped step did not advance (step N after one skip: count N - 2, not N - 1).
    schedule = learning_rate_schedule(t.cfg)
    for r in [record, *flagged]:
        count = r["step"] - 1 - (r["skipped_steps"] - r["skipped"])  # steps applied before this one
        assert r["learning_rate"] == pytest.approx(float(schedule(count)), rel=1e-6), r["step"]
        assert r["learning_rate"] != pytest.approx(float(schedule(count + 1)), rel=1e-4), r["step"]


def test_a_skipped_spike_equals_never_seeing_that_batch(tmp_path):
    """skip_spikes: the update of the spiked batch is not applied. The reference run never draws
    that batch at all; parameters and optimizer state end bitwise equal."""
    common = ["stability.min_history=10", "stability.spike_threshold=5", "train.steps=30"]
    spiked = trainer(tmp_path / "a", *common, "stability.skip_spikes=true", "chaos.spike_at_steps=[20]",
                     "chaos.spike_factor=50")
    records = [spiked.step() for _ in range(25)]
    assert [r["step"] for r in records if r["spike"]] == [20] and records[19]["skipped"]
    reference = trainer(tmp_path / "b", *common)
    for step in range(1, 25):
        if step == 20:
            reference.data.skip_batches(1)  # batch 19 (step 20's) is never drawn
        reference.step()
    assert_trees_equal(host(spiked.state["params"]), host(reference.state["params"]), what="params ")
    assert_trees_equal(host(spiked.state["opt_state"]), host(reference.state["opt_state"]), what="opt_state ")


def test_z_loss_is_added_and_reported(tmp_path):
    plain = trainer(tmp_path, "train.steps=1").step()
    with_z = trainer(tmp_path, "train.steps=1", "stability.z_loss=1e-2").step()
    assert with_z["loss"] == plain["loss"]  # the cross-entropy itself is reported unchanged
    assert with_z["z_loss"] > 0 and with_z["grad_norm"] != plain["grad_norm"]  # the objective did change


# ----------------------------------------------------------------------------- spike statistics


def reference_statistics(losses, grad_norms, *, window, min_history, threshold, rebaseline_after, min_rise,
                         divergence_rise, level_values=10):
    """An independent numpy model of the step's spike logic with skip_spikes. Per step, over the last
    `window` accepted values: the loss's level (median of the last `level_values`), its lowest level
    (the smallest such median in the window), its noise (1.4826 x median |successive difference| /
    sqrt 2); the loss's z against level and noise, the grad norm's z against its median and MAD; the
    spike flag (z > threshold and rise > min_rise, or the rise over the lowest level > divergence_rise),
    whether the update was skipped; and the accepted values held at the end."""
    history: list[tuple[float, float]] = []  # (loss, grad norm) of accepted steps since the last re-baseline
    run, out = 0, []
    for loss, gn in zip(losses, grad_norms):
        finite = np.isfinite(loss) and np.isfinite(gn)
        recent = np.array(history[-window:], np.float64).reshape(-1, 2)
        ready = len(history) >= min_history
        z, rise, divergence = np.zeros(2), 0.0, 0.0
        if ready:
            h = recent[:, 0]
            level = np.median(h[-level_values:])
            medians = [np.median(h[j - level_values:j]) for j in range(level_values, len(h) + 1)]
            lowest = min(medians) if medians else level
            noise = max(1.4826 * np.median(np.abs(np.diff(h))) / np.sqrt(2), 1e-6)
            g = recent[:, 1]
            g_sigma = max(1.4826 * np.median(np.abs(g - np.median(g))), 1e-6)
            z = np.array([(loss - level) / noise, (gn - np.median(g)) / g_sigma])
            rise, divergence = (loss - level) / abs(level), (loss - lowest) / abs(lowest)
        spike = bool(finite and ready and ((z[0] > threshold and rise > min_rise) or divergence > divergence_rise))
        skipped = (not finite) or spike
        run = run + 1 if spike else (0 if finite else run)
        if run >= rebaseline_after:  # spikes in a row: the statistics restart from this value
            history, run = [(loss, gn)], 0
        elif not skipped:
            history.append((loss, gn))
        out.append((z, spike, skipped))
    return out, history[-window:]


def statistics_against_reference(losses, grad_norms, *, W, M, threshold, K, R, D):
    """Run the jitted statistics (what step.py does with them, skip_spikes on) over the sequence and
    compare every step with `reference_statistics`: flags, z-scores, and the history held at the end.
    Returns the reference's per-step output and the final statistics."""
    from jaxtrain.train.stability import init_statistics, spike_check, update_statistics
    cfg = load_config(TINY, [f"stability.window={W}", f"stability.min_history={M}", "stability.skip_spikes=true",
                             f"stability.min_rise={R}", f"stability.divergence_rise={D}",
                             f"stability.spike_threshold={threshold}", f"stability.rebaseline_after={K}"])

    def one(stats, loss, grad_norm):
        check = spike_check(cfg, stats, loss, grad_norm)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        spike = finite & check["spike"]
        skip = ~finite | spike
        return update_statistics(cfg, stats, loss, grad_norm, ~skip), (check["loss_z"], check["grad_norm_z"], spike, skip)

    stats = init_statistics(W)
    step = jax.jit(one)
    got = []
    for loss, gn in zip(losses, grad_norms):
        stats, flags = step(stats, jnp.float32(loss), jnp.float32(gn))
        got.append(jax.device_get(flags))
        # Finite at every step, the buffer's empty slots included: a state with a NaN is never checkpointed.
        assert all(np.isfinite(np.asarray(v)).all() for v in stats.values()), len(got)
    expected, held = reference_statistics(np.float32(losses).astype(np.float64), np.float32(grad_norms).astype(np.float64),
                                          window=W, min_history=M, threshold=threshold, rebaseline_after=K,
                                          min_rise=R, divergence_rise=D)
    for i, ((loss_z, gn_z, spike, skip), (z, ref_spike, ref_skip)) in enumerate(zip(got, expected)):
        assert (bool(spike), bool(skip)) == (ref_spike, ref_skip), i
        if np.isfinite(losses[i]):
            np.testing.assert_allclose([loss_z, gn_z], z, rtol=1e-4, atol=1e-3, err_msg=f"step {i}")
    assert len(held) == min(W, int(stats["count"]))
    np.testing.assert_array_equal(np.sort(np.asarray(stats["loss_history"])[:len(held)] if int(stats["count"]) < W
                                          else np.asarray(stats["loss_history"])),
                                  np.sort(np.float32([h[0] for h in held])))
    assert int(stats["skipped_steps"]) == sum(e[2] for e in expected)
    return expected, stats


def test_spike_statistics_are_the_level_noise_and_lowest_level_of_the_last_window_accepted_values():
    """The jitted statistics against numpy over a sequence with every kind of outlier: a spike (skipped,
    so it never enters), a NaN, a loss far BELOW the rest (accepted: the test is one-sided, and it moves
    a median by one rank only), a grad-norm outlier (reported, flags nothing: a gradient-norm jump
    alone is evidence, not a spike), a loss ~6 noise sigmas up but only ~9% above its level (no
    spike: below min_rise), wrap-around of the window, and a level shift re-baselined after 3 spikes in
    a row. The old statistics (median and MAD of the whole window) give other z-scores."""
    W, M, threshold, K, R, D = 16, 4, 4.0, 3, 0.1, 0.5
    rng = np.random.default_rng(0)
    n = 64
    losses = (3.0 - 0.01 * np.arange(n) + 0.02 * rng.standard_normal(n)).astype(np.float32)
    grad_norms = (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32)
    losses[10], losses[11], losses[18], grad_norms[14] = 50.0, np.nan, -20.0, 40.0
    losses[25] += 0.25  # ~6 noise sigmas, but ~9% above its level: below min_rise, no spike
    losses[40:] += 5.0  # a level shift: spikes at 40, 41, 42, then the statistics restart from there
    expected, stats = statistics_against_reference(losses, grad_norms, W=W, M=M, threshold=threshold, K=K, R=R, D=D)
    assert [i for i, e in enumerate(expected) if e[1]] == [10, 40, 41, 42]
    assert expected[14][0][1] > 100 and expected[25][0][0] > threshold  # outliers both, spikes neither
    assert not expected[18][1] and not expected[18][2]  # a low loss is no spike (and enters the history)
    assert not any(e[2] for e in expected[43:])  # after the re-baseline every step is applied again
    assert int(stats["count"]) == n - 42 and int(stats["spike_run"]) == 0  # values since the re-baseline at 42


def test_a_diverging_loss_is_a_spike_though_its_noise_hides_it_from_the_sigma_test():
    """A loss that wobbles by +-0.5 (its noise ~1 nat a step) while its mean climbs from 3 to 5, as a
    learning rate far too high makes it: no step is 4 noise sigmas above the level, but once the loss
    is more than 50% above the lowest level of the window, each such step is a spike."""
    W, M, threshold, K, R, D = 32, 8, 4.0, 100, 0.1, 0.5
    n = 40
    wobble = 0.5 * (-1.0) ** np.arange(n)
    losses = (3.0 + np.where(np.arange(n) < 16, 0.0, 0.1 * (np.arange(n) - 16)) + wobble).astype(np.float32)
    grad_norms = np.ones(n, np.float32)
    expected, _ = statistics_against_reference(losses, grad_norms, W=W, M=M, threshold=threshold, K=K, R=R, D=D)
    flagged = [i for i, e in enumerate(expected) if e[1]]
    assert flagged and all(expected[i][0][0] < threshold for i in flagged), [(i, expected[i][0]) for i in flagged]
    assert all(losses[i] > 1.5 * 2.5 for i in flagged)  # above the lowest level (2.5 + ...) by half
    assert flagged[0] >= 16 and not any(e[1] for e in expected[:16])  # nothing while the mean was flat


def test_a_level_shift_with_skip_spikes_is_rebaselined_and_training_goes_on(tmp_path):
    """The loss (and gradients) x3 from step 30 to the end, skip_spikes on and no rollbacks: a level
    shift, not a bad batch. After rebaseline_after=4 skipped spikes in a row the statistics restart at
    the new level (a spike_rebaseline event) and every later update is applied; the model keeps
    learning. Frozen statistics would skip every step from 30 on for ever."""
    K = 4
    t = trainer(tmp_path, "stability.skip_spikes=true", "stability.max_spikes=0", "stability.min_history=20",
                "stability.window=20", "stability.spike_threshold=5", f"stability.rebaseline_after={K}",
                f"chaos.spike_at_steps={list(range(30, 61))}", "chaos.spike_factor=3", "train.steps=60",
                "checkpoint.every_steps=0", write_files=True)
    try:
        records = [t.step() for _ in range(60)]
    finally:
        t.close()
    assert [r["step"] for r in records if r["skipped"]] == [30, 31, 32, 33]
    assert [r["step"] for r in records if r["spike"]] == [30, 31, 32, 33]
    events = read_jsonl(tmp_path / "events.jsonl")
    rebaselines = [e for e in events if e["kind"] == "spike_rebaseline"]
    assert [(e["step"], e["spikes_in_a_row"]) for e in rebaselines] == [(33, K)]
    # Learning goes on at the new level: the x3 loss falls after the re-baseline.
    loss = {r["step"]: r["loss"] for r in records}
    assert np.mean([loss[s] for s in range(56, 61)]) < np.mean([loss[s] for s in range(34, 39)]) - 0.05


# ----------------------------------------------------------------------------- rollback


# Spikes at steps 29, 31, 33 (batches 28, 30, 32) with a checkpoint every 10 steps: the rollback at 33
# goes back to step 20 (the last checkpoint before the first spike), discarding the committed step-30
# checkpoint, and skips batches 20..47: up to the last bad one (32), and 15 more. The NaN at step 12 is one skipped step that
# every later checkpoint carries (skipped_steps 1 in the progress line and the done event). Saves are
# synchronous, so what a kill leaves committed does not depend on timing.
# min_history=10 here and below: a MAD of only 5 values is noisy enough to flag this tiny run's
# normal grad-norm wobble at step 8 (6.7 sigma); from 10 values on no clean step exceeds 3.1.
ROLLBACK = ["train.steps=60", "train.log_every=1", "checkpoint.every_steps=10", "checkpoint.keep_last=10",
            "checkpoint.async_save=false",
            "stability.min_history=10", "stability.window=20", "stability.spike_threshold=5",
            "stability.max_spikes=3", "stability.skip_batches=15", "chaos.spike_at_steps=[29,31,33]",
            "chaos.spike_factor=50", "chaos.nan_at_steps=[12]"]


def train(out: Path, *extra: str, attempt: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": "", "JAXTRAIN_RESTART_ATTEMPT": str(attempt)}
    return subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", TINY, f"run.output_dir={out}",
                           *SMALL, *ROLLBACK, *extra, "--cpu-devices", "1"], capture_output=True, text=True,
                          timeout=600, env=env)


def progress_lines(stdout: str) -> dict[int, str]:
    """The progress line of each step printed (`step N/TOTAL  loss ...`); a step printed twice: the later."""
    return {int(line.split()[1].split("/")[0]): line for line in stdout.splitlines() if line.startswith("step ")}


@pytest.mark.slow
def test_persistent_spikes_roll_back_once_skip_the_bad_batches_and_survive_a_restart(tmp_path):
    out = tmp_path / "run"
    # First attempt: spikes at 29, 31, 33 -> one rollback to the step-20 checkpoint, discarding the
    # step-30 one, batches 20..47 skipped (15 past the last bad one, 32); training goes on from 20, saves a new step-30 checkpoint and
    # is killed at step 38.
    killed = train(out, "chaos.kill_at_step=38")
    assert killed.returncode == -9, killed.stderr[-3000:]
    events = read_jsonl(out / "events.jsonl")
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    assert len(rollbacks) == 1, rollbacks
    rollback = rollbacks[0]
    assert (rollback["from_step"], rollback["to_step"], rollback["spike_steps"]) == (33, 20, [29, 31, 33])
    assert rollback["batches_skipped"] == 28 and rollback["discarded_checkpoints"] == [30]
    assert (rollback["data_from"], rollback["data_to"], rollback["spike_batches"]) == (20, 48, [28, 30, 32])
    # Every drill is in events.jsonl, and so is what the guard made of it (the NaN: skipped; the spikes).
    drills = [(e["step"], e["drill"], e.get("batch")) for e in events if e["kind"] == "chaos"]
    assert drills == [(12, "nan", 11), (29, "spike", 28), (31, "spike", 30), (33, "spike", 32), (38, "kill", None)]
    assert [e["step"] for e in events if e["kind"] == "nonfinite_skipped"] == [12]
    spikes = [e for e in events if e["kind"] == "spike"]
    assert [e["step"] for e in spikes] == [29, 31, 33] and all(e["loss_z"] > 5 and not e["skipped"] for e in spikes)
    # The pre-rollback step-30 checkpoint is gone: the only step 30 listed was committed after the rollback.
    listed = {c["step"]: c for c in list_checkpoints(str(out / "checkpoints")) if c["valid"]}
    assert sorted(listed) == [10, 20, 30], listed
    assert json.loads((Path(listed[30]["path"]) / MARKER).read_text())["unix_time"] > rollback["time"]
    first_pass = {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl")}  # later lines win
    lines = progress_lines(killed.stdout)
    assert "skipped" not in lines[11] and lines[12].endswith("  skipped 1") and lines[37].endswith("  skipped 1")

    # The restart resumes from the new step-30 checkpoint, draws none of the bad batches again (the
    # data position it restores is already past them), meets no spike, and finishes.
    resumed = train(out, "chaos.kill_at_step=38", attempt=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = read_jsonl(out / "events.jsonl")
    second = events[max(i for i, e in enumerate(events) if e["kind"] == "start"):]  # the restart's events
    assert [e["kind"] for e in events].count("rollback") == 1  # no second rollback
    assert next(e for e in second if e["kind"] == "resume")["restored_step"] == 30
    assert not any(e["kind"] in ("chaos", "spike", "nonfinite_skipped") for e in second), second
    assert (second[-1]["kind"], second[-1]["skipped_steps"], second[-1]["rollbacks"]) == ("done", 1, 1)
    lines = progress_lines(resumed.stdout)
    assert sorted(lines) == list(range(31, 61)) and all(line.endswith("  skipped 1") for line in lines.values())
    metrics = read_jsonl(out / "metrics.jsonl")
    after_restart = {m["step"]: m["loss"] for m in metrics}  # later lines win: the second attempt's
    for step in range(31, 38):  # (38 was killed before it was logged) the same batches, the same losses
        assert after_restart[step] == first_pass[step], step
    assert not any(m["spike"] for m in metrics[-30:])  # the second attempt's steps 31..60
    # Every committed checkpoint is finite, and its data position is its step, plus the 28 skipped
    # batches after the rollback's target (the step-30 one included: the discarded one had 30).
    checkpoints = Checkpointer(str(out / "checkpoints"), load_config(out / "config.yaml").checkpoint)
    cfg = load_config(out / "config.yaml", ["checkpoint.compilation_cache_dir=null"])
    abstract = Trainer(cfg, write_files=False, devices=jax.devices()[:1]).abstract_state()
    good = [c["step"] for c in list_checkpoints(str(out / "checkpoints")) if c["valid"]]
    assert good == [10, 20, 30, 40, 50, 60]
    for step in good:
        state, extra = checkpoints.restore(step, abstract)
        assert all(np.isfinite(v).all() for v in named_leaves(state).values() if v.dtype.kind == "f"), step
        assert extra["data"]["index"] == step + (28 if step > 20 else 0), step


# A checkpoint every 10 steps, spikes at steps 35, 37, 39 (batches 34, 36, 38) and skip_batches=2: the
# checkpoint before the spikes (step 30) lies further from them than skip_batches. Skipping only
# skip_batches batches from the checkpoint's data position (30, 31) would draw 34, 36 and 38 again,
# two steps earlier, and roll back again until stability.max_rollbacks is spent (exit 78).
REPLAY = ["train.steps=50", "train.log_every=1", "checkpoint.every_steps=10", "checkpoint.keep_last=10",
          "checkpoint.async_save=false", "stability.min_history=10", "stability.window=20",
          "stability.spike_threshold=5", "stability.max_spikes=3", "stability.skip_batches=2",
          "stability.max_rollbacks=2", "chaos.spike_at_steps=[35,37,39]", "chaos.spike_factor=50"]


class Drawn:
    """Wraps the trainer's data iterator and records the data position of every batch drawn."""

    def __init__(self, inner):
        self.inner, self.positions = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __iter__(self):
        return self

    def __next__(self):
        self.positions.append(self.inner.position)
        return next(self.inner)


def test_a_rollback_skips_past_spikes_further_from_the_checkpoint_than_skip_batches(tmp_path):
    first = trainer(tmp_path, *REPLAY, write_files=True)
    first.data = drawn = Drawn(first.data)
    # No checkpoint after step 30: the restart below resumes from the rollback's own target.
    should_save = first.checkpointer.should_save
    first.checkpointer.should_save = lambda step, **kw: step <= 30 and should_save(step, **kw)
    try:
        result = first.fit()
    finally:
        first.close()
    assert result == {"step": 50, "exit_code": 0}, result
    events = read_jsonl(tmp_path / "events.jsonl")
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    assert len(rollbacks) == 1, rollbacks
    r = rollbacks[0]
    assert (r["from_step"], r["to_step"], r["spike_steps"], r["spike_batches"]) == (39, 30, [35, 37, 39], [34, 36, 38])
    assert (r["data_from"], r["data_to"], r["batches_skipped"]) == (30, 41, 11)  # past batch 38, plus 2
    # Batches 0..39 before the rollback (step 40's was queued when step 39's spike was read), then
    # steps 31..50 draw 41..60: none of the spiking batches again, and no spike after the rollback.
    assert drawn.positions == list(range(40)) + list(range(41, 61)), drawn.positions
    after = events[events.index(r) + 1:]
    assert not any(e["kind"] in ("chaos", "spike", "rollback_limit") for e in after), after
    assert [e["step"] for e in events if e["kind"] == "spike"] == [35, 37, 39]

    # A restart from the rollback's target (step 30, data position 30) skips the same range: the
    # record in rollbacks.json holds it.
    assert [c["step"] for c in list_checkpoints(str(tmp_path / "checkpoints")) if c["valid"]] == [10, 20, 30]
    restarted = trainer(tmp_path, *REPLAY, write_files=True)
    restarted.data = drawn = Drawn(restarted.data)
    try:
        assert restarted.resumed_from == 30 and restarted.data.position == 30
        result = restarted.fit()
    finally:
        restarted.close()
    assert result == {"step": 50, "exit_code": 0}, result
    assert drawn.positions == list(range(41, 61)), drawn.positions
    events = read_jsonl(tmp_path / "events.jsonl")
    second = events[max(i for i, e in enumerate(events) if e["kind"] == "start"):]
    assert not any(e["kind"] in ("chaos", "spike", "rollback") for e in second), second
    assert len(json.loads((tmp_path / "checkpoints/rollbacks.json").read_text())["rollbacks"]) == 1


class Died(Exception):
    """Stands for the process dying at that point."""


def test_a_rollback_that_died_before_discarding_is_completed_at_the_next_start(tmp_path):
    """The process dies after recording the rollback (rollbacks.json) but before discarding the
    step-30 checkpoint; the next start discards it, resumes from the target and skips the same batches."""
    t = trainer(tmp_path, *ROLLBACK, write_files=True)

    def die(step: int, committed_before: float | None = None) -> list[int]:
        raise Died(f"discard_after({step})")

    t.checkpointer.discard_after = die  # the rollback at step 33 dies here
    with pytest.raises(Died, match=r"discard_after\(20\)"):
        t.fit()
    t.close()
    assert [c["step"] for c in list_checkpoints(str(tmp_path / "checkpoints")) if c["valid"]] == [10, 20, 30]
    recorded = json.loads((tmp_path / "checkpoints/rollbacks.json").read_text())["rollbacks"]
    assert [r["to_step"] for r in recorded] == [20]

    restarted = trainer(tmp_path, *ROLLBACK, write_files=True)
    try:
        assert [c["step"] for c in list_checkpoints(str(tmp_path / "checkpoints")) if c["valid"]] == [10, 20]
        assert restarted.resumed_from == 20 and restarted.data.position == 20
        record = restarted.step()  # step 21 draws batch 48: batches 20..47 (the bad 28, 30, 32 among them) skipped
        assert restarted.data.position == 48 + 1 and not record["spike"]
    finally:
        restarted.close()


@pytest.mark.slow
def test_spikes_after_the_last_allowed_rollback_stop_the_run_with_exit_78(tmp_path):
    # 78 ("stop, a human is needed"), no longer 75: a restart would only hit the same spikes again.
    out = tmp_path / "run"
    r = train(out, "stability.max_rollbacks=0")
    assert r.returncode == 78 and "stability.max_rollbacks=0" in r.stderr, r.stderr[-3000:]
    last = read_jsonl(out / "events.jsonl")[-1]
    assert last["kind"] == "rollback_limit" and last["exit_code"] == 78


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("override, message", [
    ("stability.window=-1", "stability.window' must be positive"),
    ("stability.spike_threshold=0", "stability.spike_threshold' must be positive"),
    ("precision.growth_factor=1", "precision.growth_factor' must be > 1"),
    ("precision.backoff_factor=1.5", "precision.backoff_factor' must be within (0, 1)"),
    ("precision.loss_scale_init=0", "precision.loss_scale_init' must be positive"),
    ("precision.min_loss_scale=1e9", "at most precision.loss_scale_init"),
    ("precision.growth_interval=0", "precision.growth_interval' must be positive"),
    ("stability.max_spikes=-1", "stability.max_spikes' must be >= 0"),
    ("stability.skip_batches=-3", "stability.skip_batches' must be >= 0"),
    ("stability.max_rollbacks=-1", "stability.max_rollbacks' must be >= 0"),
    ("stability.z_loss=-0.1", "stability.z_loss' must be >= 0"),
    ("stability.min_history=1", "stability.min_history' must be at least 2"),
    ("stability.min_history=150", "stability.min_history' must be at most stability.window (100)"),
    ("stability.rebaseline_after=0", "stability.rebaseline_after' must be >= 1"),
    ("chaos.nan_at_steps=[0]", "chaos.nan_at_steps' must be a list of step numbers >= 1"),
    ("chaos.spike_factor=0", "chaos.spike_factor' must be positive"),
])
def test_bad_numerics_keys_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(TINY, [override])


def test_bad_numerics_key_exits_2_through_the_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", TINY,
                        f"run.output_dir={tmp_path / 'r'}", "stability.window=0"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_min_history_follows_the_window_unless_set():
    """`stability.window=10` alone is accepted (min_history, unset, follows it: min(20, window));
    a min_history the user sets is checked against the window as before."""
    assert load_config(TINY, ["stability.window=10"]).stability.history_needed == 10
    assert load_config(TINY, []).stability.history_needed == 20
    assert load_config(TINY, ["stability.min_history=5"]).stability.history_needed == 5
    with pytest.raises(ConfigError, match="stability.min_history"):
        load_config(TINY, ["stability.window=10", "stability.min_history=20"])


def test_the_chaos_factor_is_an_input_of_the_step_not_a_recompile(tmp_path):
    """chaos.nan_at_steps / spike_at_steps reach the jitted step as its third argument, a replicated
    scalar: one compiled step runs every factor. Without drills the step ignores it (the constant 1)."""
    t = trainer(tmp_path, "chaos.spike_at_steps=[5]")
    try:
        compiled = t.layout.lower_train_step().compile()
        from jaxtrain.parallel.sharding import global_batch
        from jaxtrain.train.step import BATCH_KEYS
        local = next(t.data)
        batch = global_batch({k: local[k] for k in BATCH_KEYS}, t.mesh, t.rules, t.cfg.data.global_batch_size)
        losses = {}
        for factor in (1.0, 4.0):
            state = jax.tree_util.tree_map(lambda x: x.copy(), t.state)  # the step donates its state
            _, metrics = compiled(state, batch, t.layout.chaos_factor(factor))
            losses[factor] = float(metrics["loss"])
        assert losses[4.0] == pytest.approx(4 * losses[1.0], rel=1e-6)
        plain = trainer(tmp_path / "plain")
        try:
            step = plain.layout.jit_train_step()
            one, four = (float(step(jax.tree_util.tree_map(lambda x: x.copy(), plain.state), batch,
                                    plain.layout.chaos_factor(f))[1]["loss"]) for f in (1.0, 4.0))
            assert one == four == pytest.approx(losses[1.0], rel=1e-6) and step._cache_size() == 1
        finally:
            plain.close()
    finally:
        t.close()
