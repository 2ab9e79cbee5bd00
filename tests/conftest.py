"""Every test runs on the CPU with 8 simulated devices (set before JAX is imported)."""

import os
import sys
import tempfile

# Tests live in one folder per part of the system (tests/fault/, tests/parallel/, ...); the
# helpers they share (trees.py, storage_servers.py, independent_attention.py) stay here.
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
# The repository root off sys.path (`python -m pytest` from it puts it there): its kernels/ folder
# installs as `jaxtrain.kernels`, and from the root it would also import as a top-level `kernels`,
# ahead of Hugging Face's `kernels` package that transformers >= 5.25 imports. The tests import
# jaxtrain from its install (editable or not), so they never need the root itself.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _REPO]

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The measured matmul peak is cached per machine (env.peak_cache_file): tests keep theirs apart from
# the user's cache, so a figure measured under the suite's load never becomes a real run's MFU peak.
os.environ.setdefault("JAXTRAIN_PEAK_CACHE", os.path.join(tempfile.mkdtemp(prefix="jaxtrain_peak_"), "peak_flops.json"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tokenized text and bucket copies (jaxtrain/data/token_cache.py, remote_files.py) go to the session's own
# cache, not the user's; the jobs tests start inherit it.
os.environ.setdefault("JAXTRAIN_DATA_CACHE", tempfile.mkdtemp(prefix="jaxtrain_data_cache_"))
# Triton kernels run under the Triton interpreter here (no GPU). Triton reads this when its
# decorators run, and transformers/torch (tests/hf/test_hf.py) import triton at collection time,
# before tests/kernels/test_kernels_triton.py could set it.
os.environ["TRITON_INTERPRET"] = "1"
# gcsfs reads this once, at import: whichever test imports it first decides for the whole session.
# Its default (true) looks up every bucket's type over a gRPC API that the GCS emulator and the
# tests' fake endpoints lack, 60 s per lookup (tests/storage_servers.py sets it for subprocesses).
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

from jaxtrain.runtime.host_malloc import retain_freed_memory  # noqa: E402

retain_freed_memory()  # what `jaxtrain train` does on the CPU: in-process Trainers run as it would

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

# Most XLA optimizations only cost compile time on these tiny test models (as in flax's lm1b
# test); numerics are compared between runs that all use the same flag.
jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(scope="module")
def child_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a job a test starts (`jaxtrain launch`, several processes): the CPU, this
    checkout importable, no 8-device flag (the launcher sets devices per process), no restart
    attempt inherited, and `CACHE`, a compilation-cache folder shared by the test module's jobs."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXTRAIN_RESTART_ATTEMPT")}
    env.update({"JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "PYTHONPATH": os.pathsep.join(sys.path)})
    env["CACHE"] = str(tmp_path_factory.mktemp("xla_cache"))
    return env


@pytest.fixture
def jaxtrain_train():
    """Run `jaxtrain train ARGS` in a subprocess as a user's shell would: without the suite's XLA flags
    and settings, so the CLI picks its own (jaxtrain/runtime/xla_cpu.py: YNNPACK fusions, wide vectors), the
    flags that in-process Trainers here never see. Returns the CompletedProcess (text, captured)."""
    import subprocess

    def run(*args: str, cwd, timeout: int = 300) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS",
                                                                 "JAXTRAIN_RESTART_ATTEMPT")}
        env["PYTHONPATH"] = os.pathsep.join(sys.path)
        return subprocess.run([sys.executable, "-m", "jaxtrain", "train", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    return run


# The second tier (`pytest -m ""` runs it too; CI runs the default tier, `-m 'not full'` in
# pyproject.toml): each entry repeats, at another layout or with another drill, a claim a test in the
# default tier makes, and costs >= ~15 s on 2 cores. With them the suite takes ~53 min on 2 cores
# (1,053 tests, 2026-12-02), over CI's 40-min budget. A whole test, or one parametrized case.
FULL_SUITE_ONLY = (
    # spikes on real text: the default tier keeps lr 1e-3 and 3e-3 with warmup 100, 1e-2 with warmup 10
    "tests/train/test_spikes_on_real_text.py::test_a_healthy_run_on_real_text_flags_no_spike[0.001-10]",
    "tests/train/test_spikes_on_real_text.py::test_a_healthy_run_on_real_text_flags_no_spike[0.003-10]",
    "tests/train/test_spikes_on_real_text.py::test_a_healthy_run_on_real_text_flags_no_spike[0.01-100]",
    # pipeline == unpipelined: the default tier keeps circular bf16 remat and GPipe fsdp x tensor accum
    "tests/parallel/test_pipeline.py::test_pipeline_matches_unpipelined[stage2_fsdp2_tensor2_circular_accum2_unfolded",
    "tests/parallel/test_pipeline.py::test_pipeline_matches_unpipelined[stage2_data4_circular_m3_accum3]",
    "tests/parallel/test_pipeline.py::test_pipeline_matches_unpipelined[stage4_data2_gpipe]",
    "tests/parallel/test_pipeline.py::test_pipeline_matches_unpipelined[stage4_data2_circular]",
    "tests/parallel/test_pipeline.py::test_pipeline_matches_unpipelined[stage8_",
    "tests/parallel/test_pipeline.py::test_pipeline_matches_unpipelined[stage2_fsdp4_gpipe_gather_fsdp_once]",
    # (the default tier keeps the QK-norm + Gemma layers case; Qwen3-MoE routing under stages, 60 s here)
    "tests/parallel/test_pipeline.py::test_pipeline_matches_unpipelined[stage2_data4_gpipe_qwen3_moe_every2]",
    "tests/parallel/test_pipeline.py::test_checkpoint_is_layout_free",
    "tests/parallel/test_pipeline.py::test_kill_and_resume_pipelined_run_is_bitwise",
    "tests/parallel/test_pipeline.py::test_stages_shift_by_collective_permute_and_gpipe_moves_no_weights",
    "tests/parallel/test_pipeline.py::test_pipelined_remat_runs_each_layer_forward_twice_not_three_times",
    "tests/parallel/test_pipeline.py::test_gather_fsdp_once_gathers_less",
    # SLURM: the default tier keeps sbatch's job and the in-allocation restart
    "tests/launch/test_slurm.py::test_the_time_limit_signal_saves_an_emergency_checkpoint",
    "tests/launch/test_slurm.py::test_killed_task_requeues_the_job",
    # local launch: kill/restart bitwise and the SIGTERM save stay
    "tests/launch/test_launch.py::test_sigterm_to_one_process_stops_the_job_together_and_it_resumes",
    "tests/launch/test_launch.py::test_a_bad_slot_is_isolated_and_the_run_continues_on_fewer_processes",
    "tests/launch/test_launch.py::test_the_same_python_error_twice_stops_a_real_job_with_78",
    "tests/launch/test_launch.py::test_hybrid_dcn_mesh_matches_one_process",
    "tests/train/test_stability.py::test_fp16_with_injected_overflows_ends_within_2_percent_of_fp32",
    # context parallelism: the default tier keeps the zig-zag ring (context 4 x data 2) and SP with CP
    "tests/parallel/test_context_train.py::test_a_context_parallel_checkpoint_restores_onto_a_layout_without_it",
    "tests/parallel/test_context_train.py::test_context_parallel_train_step_equals_data_parallel[pallas-",
    "tests/parallel/test_context_train.py::test_context_parallel_train_step_equals_data_parallel[ring-plain-",
    "tests/parallel/test_context_train.py::test_context_parallel_train_step_equals_data_parallel[allgather-",
    "tests/parallel/test_context_train.py::test_sequence_parallel_activations_equal_data_parallel[tensor",
    "tests/parallel/test_context.py::test_context_attention_equals_independent_float64[2-allgather-zigzag-pallas",
    "tests/parallel/test_context_train.py::test_context_parallel_train_step_equals_data_parallel[ring-zigzag-context8",
    "tests/parallel/test_context.py::test_context_attention_equals_independent_float64[4-ring-plain-triton",
    "tests/parallel/test_context.py::test_context_attention_equals_independent_float64[2-allgather-zigzag-triton",
    # local tier: the kill, the lost slot's peer copy and the isolation stay
    "tests/checkpoint/test_local_tier.py::test_three_hosts_with_private_disks",
    "tests/checkpoint/test_local_tier.py::test_a_damaged_local_copy_is_refused_for_the_persistent_tier",
    "tests/checkpoint/test_local_tier.py::test_both_copies_of_a_slot_gone_fall_back_to_the_persistent_tier",
    "tests/checkpoint/test_resume.py::test_fp16_resume_restores_loss_scale_and_spike_statistics_bitwise",
    "tests/checkpoint/test_resume.py::test_checkpoint_of_another_model_shape_exits_2_untouched",
    "tests/checkpoint/test_object_storage.py::test_sigkill_then_same_command_resumes_bitwise[gs]",
    # fault drills: the in-step hang, the frozen heartbeat, the bad link and the straggler factor 2 stay
    "tests/fault/test_fault.py::test_a_slow_process_is_reported_as_a_straggler_and_a_clean_run_has_none",
    "tests/fault/test_fault.py::test_preflight_names_a_slowed_process_and_can_stop_the_job",
    "tests/fault/test_fault.py::test_a_hung_process_is_detected_on_both_and_the_job_restarts_and_finishes",
    "tests/fault/test_stragglers.py::test_a_slowed_process_is_named_at_factor_two[4]",
    "tests/fault/test_preemption.py::test_fresh_start_with_a_late_process_takes_the_same_collective_path",
    # the initial loss of every shipped config: the largest shapes (others stay)
    "tests/model/test_model.py::test_initial_loss_is_near_ln_vocab_for_every_shipped_config[llama3-70b]",
    "tests/model/test_model.py::test_initial_loss_is_near_ln_vocab_for_every_shipped_config[deepseek-moe-16b]",
    "tests/model/test_model.py::test_initial_loss_is_near_ln_vocab_for_every_shipped_config[mixtral-8x7b]",
    "tests/model/test_model.py::test_initial_loss_is_near_ln_vocab_for_every_shipped_config[qwen3-30b-a3b]",
    # MLA alone: the DeepSeek-V3 layouts (data2_expert4_deepseek, data2_fsdp2_tensor2_deepseek) include it
    "tests/parallel/test_parallelism.py::test_layout_matches_single_device[data2_tensor4_mla]",
    "tests/parallel/test_parallelism.py::test_layout_matches_single_device[data2_fsdp2_tensor2_mla]",
    # the skip contract: fp16 (loss scaling on top) stays for every optimizer, fp32 for adamw
    "tests/train/test_optimizers.py::test_a_skipped_step_keeps_the_optimizer_state_bitwise[adafactor-fp32]",
    "tests/train/test_optimizers.py::test_a_skipped_step_keeps_the_optimizer_state_bitwise[lion-fp32]",
    "tests/train/test_optimizers.py::test_a_skipped_step_keeps_the_optimizer_state_bitwise[sgd-fp32]",
    "tests/train/test_optimizers.py::test_a_skipped_step_keeps_the_optimizer_state_bitwise[schedule_free-fp32]",
    "tests/train/test_optimizers.py::test_a_skipped_step_keeps_the_optimizer_state_bitwise[muon-fp32]",
    "tests/model/test_model.py::test_initial_loss_is_near_ln_vocab_for_every_shipped_config[gpt-oss-120b]",
    "tests/model/test_model.py::test_initial_loss_is_near_ln_vocab_for_every_shipped_config[deepseek-v3-671b]",
    "tests/test_train.py::test_tiny_config_reaches_the_entropy_floor[moe-tiny]",
    "tests/model/test_attention_in_model.py::test_xla_attention_with_a_sharded_sequence_equals_one_device",
    "tests/model/test_attention_in_model.py::test_pallas_train_step_equals_xla",
    "tests/model/test_attention_in_model.py::test_fewer_kv_heads_than_the_tensor_degree_equals_single_device_xla[pallas]",
    "tests/train/test_memory.py::test_vocab_sized_temporaries_fall_with_fsdp",
    "tests/train/test_memory.py::test_the_guard_copies_no_optimizer_state",
    "tests/parallel/test_parallelism.py::test_layout_matches_single_device[data8]",
    "tests/parallel/test_parallelism.py::test_layout_matches_single_device[tensor8]",
    "tests/observe/test_prometheus.py::test_both_processes_are_scraped_while_training_and_the_values_move",
    # MoE: dropless expert=4 x data=2 and fsdp x expert x tensor stay
    "tests/parallel/test_expert_parallel.py::test_expert4_data2_equals_data8[capacity]",
    "tests/parallel/test_expert_parallel.py::test_checkpoint_restores_across_expert_parallel_sizes",
    # MoE inside pipeline stages: the default tier keeps GPipe x expert x data with the routing bias
    "tests/parallel/test_expert_parallel.py::test_expert_parallel_inside_pipeline_stages_equals_data8[circular_",
    "tests/parallel/test_expert_parallel.py::test_expert_parallel_inside_pipeline_stages_equals_data8[gpipe_expert2_fsdp2",
    "tests/observe/test_moe_inspect.py::test_inspect_deepseek_preset_compiles_from_shapes",
    # second round (the default tier at ~30 min was still over budget on CI's slower CPU)
    "tests/parallel/test_pipeline.py::test_pipeline_matches_unpipelined[stage2_fsdp2_tensor2_gpipe_accum2_save_qkv_proj]",
    "tests/parallel/test_pipeline.py::test_every_remat_policy_compiles_and_keeps_the_gradients[full-pipelined]",
    "tests/parallel/test_pipeline.py::test_every_remat_policy_compiles_and_keeps_the_gradients[dots-pipelined]",
    "tests/parallel/test_context_train.py::test_sequence_parallel_activations_equal_data_parallel[context2",
    "tests/parallel/test_parallelism.py::test_layout_matches_single_device[fsdp8]",
    "tests/parallel/test_parallelism.py::test_layout_matches_single_device[fsdp8_qknorm]",
    "tests/parallel/test_tensor_across_processes.py::test_a_tensor_ring_across_two_processes_trains_like_one_process",
    "tests/launch/test_slurm.py::test_killed_task_restarts_the_step_inside_the_allocation",
    "tests/fault/test_preemption.py::test_no_cross_process_call_on_ordinary_steps",
    "tests/fault/test_stragglers.py::test_saves_and_a_resume_name_nobody",
    "tests/fault/test_fault.py::test_a_frozen_process_is_blamed_by_its_stale_heartbeat",
    "tests/fault/test_preflight_processes.py::test_two_nodes_of_four_processes_with_a_slower_network_name_nobody",
    "tests/observe/test_goodput.py::test_a_real_run_with_a_hang_and_a_restart",
    "tests/checkpoint/test_local_tier.py::test_a_lost_slot_directory_resumes_from_the_peer_copy_bitwise",
    "tests/checkpoint/test_resume.py::test_sigterm_saves_exits_75_and_loses_no_step",
    "tests/data/test_data_e2e.py::test_loss_falls_on_prepared_stdlib_text",
    "tests/train/test_memory.py::test_initialisation_under_the_runs_cpu_flags_needs_less_than_the_state",
    "tests/train/test_precision.py::test_the_default_scale_means_the_same_at_any_tokens_per_step",
    # third round (2026-12-06: CI took 37.7 min of its 40): repeats of a claim at another setting; each keeps a
    # sibling in the default tier (spikes at 3e-3 and 1e-2; adamw, adafactor, lion and muon reach the floor and
    # adafactor and muon restore onto another mesh; tiny, Gemma 3 and DeepSeek-V3 train to the floor and resume
    # after SIGKILL; a bad card at 3+1 processes, a slower network at 2+2)
    "tests/train/test_spikes_on_real_text.py::test_a_healthy_run_on_real_text_flags_no_spike[0.001-100]",
    "tests/train/test_optimizers.py::test_tiny_config_reaches_the_entropy_floor[sgd]",
    "tests/train/test_optimizers.py::test_tiny_config_reaches_the_entropy_floor[schedule_free]",
    "tests/train/test_optimizers.py::test_checkpoint_restores_onto_another_mesh[lion]",
    "tests/train/test_optimizers.py::test_checkpoint_restores_onto_another_mesh[sgd]",
    "tests/train/test_optimizers.py::test_checkpoint_restores_onto_another_mesh[schedule_free]",
    "tests/checkpoint/test_resume_families.py::test_a_killed_family_run_resumes_bitwise[qwen3-tiny]",
    "tests/checkpoint/test_resume_families.py::test_a_killed_family_run_resumes_bitwise[qwen3-moe-tiny]",
    "tests/checkpoint/test_resume_families.py::test_a_killed_family_run_resumes_bitwise[gpt-oss-tiny]",
    "tests/test_train.py::test_tiny_config_reaches_the_entropy_floor[qwen3-tiny]",
    "tests/test_train.py::test_tiny_config_reaches_the_entropy_floor[qwen3-moe-tiny]",
    "tests/test_train.py::test_tiny_config_reaches_the_entropy_floor[gpt-oss-tiny]",
    "tests/fault/test_preflight_processes.py::test_a_bad_network_card_is_named[4-2]",
    "tests/fault/test_preflight_processes.py::test_healthy_nodes_with_a_slower_network_name_nobody[3+1]",
)


# First: xdist's worker turns the xdist_group marker into the node id's "@group" suffix in its own
# pytest_collection_modifyitems, registered after this file (so called before it, hooks being
# last-registered-first). Without tryfirst the marker came too late and both workers ran
# multi-process tests at once.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (`-n 2 --dist loadgroup`, the README's test command) the tests that start
    several processes, or a SLURM job, run one at a time on one worker: they already use every
    core, and their deadlines (hang timeouts, straggler factors) assume they are not sharing the
    machine with another such job. The in-process tests, mostly single-threaded compiles, share
    the other worker."""
    matched = set()
    for item in items:
        if item.nodeid.startswith(FULL_SUITE_ONLY):
            item.add_marker(pytest.mark.full)
            matched.update(p for p in FULL_SUITE_ONLY if item.nodeid.startswith(p))
        if item.get_closest_marker("multiprocess") or item.get_closest_marker("slow") or \
                item.path.name == "test_slurm.py":
            item.add_marker(pytest.mark.xdist_group("processes"))
    # A renamed test would leave its entry naming nothing (and itself back in the default tier).
    files = {i.nodeid.split("::")[0] for i in items}
    stale = [p for p in FULL_SUITE_ONLY if p not in matched and p.split("::")[0] in files]
    if stale and not any("::" in a for a in config.args):  # (node ids asked for: the rest of a file is not collected)
        raise pytest.UsageError(f"tests/conftest.py FULL_SUITE_ONLY names no collected test: {stale}")
