"""Test-wide setup: 8 fake CPU devices, so multi-device code paths run on any machine; and the
`slow` marker, applied here from one list (SLOW) so that no test file needs editing for it.

Must run before the first backend use; pytest imports conftest.py before collecting tests.

Two tiers: `python -m pytest -q -n 2 -m "not slow" tests` is the inner loop (a few minutes on
2 cores); CI (.ci/run, the README's test command) runs everything, `slow` included.
"""

import atexit
import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)

# XLA:CPU's code generation at LLVM -O0, in this process and every process it starts (they
# inherit XLA_FLAGS): the tests' programs are tiny, so compiling is most of the suite's time,
# and -O0 takes ~27% off it (tests/test_update.py 119 -> 85 s, tests/test_main.py 66 -> 49 s,
# quiet 2-core machine). It changes no HLO and, measured, no number a test checks: five
# runlocal steps give bitwise the same completions, parameters and compiled HLO at -O0 and at
# XLA's default; tests/test_suite_setup.py keeps checking that against a default-flags process.
# Only float rounding inside fused elementwise code can move (the sampler-vs-trainer
# log-prob drift metric moved by 5e-7). RLX_TESTS_XLA_OPT=default runs the suite at XLA's
# default instead; a value already in XLA_FLAGS is kept.
O0_FLAG = "--xla_backend_optimization_level=0"
if (os.environ.get("RLX_TESTS_XLA_OPT", "O0") == "O0"
    and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {O0_FLAG}".strip()

# One persistent XLA compilation cache for the processes the tests start (`python -m
# rlx.main`, CLIs, sweeps, notebooks): they compile the same small programs again and again
# (a kill -9 test runs one config four times), and on 2 cores compiling is most of their time.
# Threshold 0: these programs compile in under JAX's default 1 s, which cached nothing
# (experiments/results/ci_timings.md). A max size turns on JAX's file lock, so two processes
# never read an entry half written. The directory belongs to one pytest run (its controller
# makes it, xdist workers and their subprocesses inherit it) and goes when that run ends. A
# test that runs rlx as another user (`nobody`) drops JAX_COMPILATION_CACHE_DIR from that
# process's environment: JAX's lock file and the entries are this user's. This process and
# the xdist workers keep the cache off, so in-process tests compile as they would for a user;
# measured, a cache of their own (unlocked) saved 46 s of the whole suite but cost the fast
# tier 25% (1 min 48 s -> 2 min 14 s: every compile then hashes its program), and writing into
# this shared one breaks it (an unlocked writer leaves entries without "-atime" files that
# the locking processes fail on; a locked one scans ~4,000 entries per write).
# RLX_TESTS_XLA_CACHE=off (any value set beforehand) runs the subprocesses without a cache.
_CACHE_VARS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
               "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30)}
if "RLX_TESTS_XLA_CACHE" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="rlx_tests_xla_cache_")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ.update({"RLX_TESTS_XLA_CACHE": _cache_dir, "JAX_COMPILATION_CACHE_DIR": _cache_dir,
                     **_CACHE_VARS})
jax.config.update("jax_compilation_cache_dir", None)

# The rule: a test is slow when it trains through rlx.main or trainer.run (in this process or
# a subprocess), starts another Python process (a CLI, a sweep, a notebook, a pytest), or
# takes over ~10 s on a quiet 2-core machine for another reason (measured with --durations).
# Each area keeps fast tests in the tier: the numerics of every module run on their own, and
# the training loop's pieces (rollout, update, checkpoint, metrics) are unit-tested there.
# An entry is a test file (every test in it) or a file::function (every parametrization);
# tests/test_slow_list.py fails when an entry no longer names a file or function.
SLOW = (
    # Whole files: every test trains a run or drives a CLI in a subprocess.
    "tests/kernels/test_import_name.py",
    "tests/test_bad_inputs.py",
    "tests/test_cli.py",
    "tests/test_hf_rl.py",
    "tests/test_main.py",
    "tests/test_resilience.py",
    # Single tests that train a run, start a process or load a model through a subprocess.
    "tests/model/test_hf.py::test_load_onto_mesh",
    "tests/model/test_hf.py::test_load_memory_small",
    "tests/model/test_scan_layers.py::test_scanned_logprob_gradients_equal_unrolled",
    "tests/model/test_scan_layers.py::test_scanned_lora_unmerged_path_equals_unrolled",
    "tests/model/test_scan_layers.py::test_scanned_gradients_on_an_fsdp_and_tensor_mesh_equal_unrolled",
    "tests/model/test_scan_layers.py::test_scanned_paged_sampler_draws_the_same_rollouts",
    "tests/test_bench_peers.py::test_rlx_worker_takes_turns",
    "tests/test_bench_peers.py::test_dead_worker_is_one_clear_error",
    "tests/test_bench_peers.py::test_tunix_worker_takes_turns",
    "tests/test_export.py::test_export_loads_in_transformers_with_rlx_logits",
    "tests/test_export.py::test_step_and_force",
    "tests/test_export.py::test_hf_base_model_tokenizer_files",
    "tests/test_export.py::test_cli",
    "tests/test_export.py::test_cli_errors_in_process",
    "tests/test_export.py::test_user_path_sentencepiece",
    "tests/test_export.py::test_user_path_sentencepiece_lora",
    "tests/test_export.py::test_latest_step_without_state_is_refused",
    "tests/test_export.py::test_full_disk_leaves_out_dir_as_it_was",
    "tests/test_export.py::test_force_replaces_the_exports_files_only",
    "tests/test_lora.py::test_a_lora_workdir_refuses_a_full_parameter_config",
    # Compile whole updates / evaluations to read XLA's buffer sizes: 30-65 s each with
    # --durations on the loaded machine (the plan's other tests stay in the fast tier).
    "tests/test_memory.py::test_gradient_accumulation_cuts_the_compiled_update_peak_and_the_plan_follows",
    "tests/test_memory.py::test_chunked_logprobs_cut_the_compiled_update_peak_and_the_plan_follows",
    "tests/test_memory.py::test_a_lora_update_with_kl_compiles_to_what_the_plan_says",
    "tests/test_memory.py::test_a_paged_evaluation_compiles_to_what_the_plan_says",
    "tests/test_notebooks.py::test_notebook_runs_and_plots",
    "tests/test_notebooks.py::test_ablations_plots_a_benchmark_results_file",
    "tests/test_pipeline.py::test_trainer_overlap_crash_then_resume_equals_uninterrupted",
    "tests/test_progress.py::test_warm_start_writes_plain_lines_when_not_a_terminal",
    "tests/test_progress.py::test_run_writes_plain_lines_when_not_a_terminal",
    "tests/test_reasoning.py::test_runlocal_trains_and_reports_lengths",
    "tests/test_report.py::test_cli_prints_summary_and_fails_clearly_without_metrics",
    "tests/test_run_safety.py::test_keep_checkpoints_zero_keeps_every_checkpoint",
    "tests/test_run_safety.py::test_negative_keep_checkpoints_is_refused",
    "tests/test_run_safety.py::test_a_held_workdir_is_refused_naming_the_holder",
    "tests/test_run_safety.py::test_two_processes_cannot_both_run",
    "tests/test_run_safety.py::test_a_linked_lock_file_is_refused_and_its_target_untouched",
    "tests/test_run_safety.py::test_a_symlinked_lock_file_is_one_line_from_the_cli",
    "tests/test_run_safety.py::test_an_unwritable_checkpoint_directory_fails_before_training",
    "tests/test_run_safety.py::test_a_failed_save_stops_with_one_line_and_keeps_the_previous_checkpoint",
    "tests/test_run_safety.py::test_a_reward_holding_the_gil_times_out_with_one_line",
    "tests/test_run_safety.py::test_a_reward_calling_sys_exit_is_an_error_not_a_clean_exit",
    "tests/test_run_safety.py::test_sigterm_during_a_hung_reward_checkpoints_and_exits_75",
    "tests/test_run_safety.py::test_sigterm_during_a_reward_after_a_saved_step_exits_75",
    "tests/test_run_safety.py::test_a_reward_calling_os_exit_is_one_error_line_not_a_clean_exit",
    "tests/test_run_safety.py::test_sigterm_before_the_rl_loop_exits_75",
    "tests/test_suite_setup.py::test_a_started_process_writes_to_and_reads_from_the_shared_cache",
    "tests/test_suite_setup.py::test_the_suites_o0_flag_changes_no_checked_number",
    "tests/test_suite_timeout.py::test_a_hang_fails_one_test_and_the_others_run_under_xdist",
    "tests/test_sweep.py::test_print_only_prints_one_command_per_run",
    "tests/test_sweep.py::test_a_shipped_experiment_is_found_by_name_from_any_directory",
    "tests/test_sweep.py::test_one_rule_finds_configs_for_main_sweep_and_load_config",
    "tests/test_sweep.py::test_a_failing_run_is_reported_not_fatal",
    "tests/test_sweep.py::test_runlocal_sweep_runs_and_gathers",
    "tests/test_task_registry.py::test_a_registered_task_runs_end_to_end",
    "tests/test_train.py::test_multi_device_matches_one_device_and_compiles_once",
    "tests/test_train.py::test_split_halves_equal_fused_step",
    # Measured: over 60 s per function (all its parametrizations) in the fast tier's first
    # --durations run (-n 2, load ~14 on 2 cores, 2026-12-05; ~5x a quiet machine): each
    # compiles several rollouts / updates or a sharded step. Their files keep fast tests.
    "tests/kernels/test_cascade_attention.py::test_cascade_equals_plain_paged_attention",
    "tests/kernels/test_paged_attention.py::test_kernel_matches_reference",
    "tests/model/test_hf.py::test_logits_match_transformers",
    "tests/model/test_transformer.py::test_cached_decode_matches_full_forward",
    "tests/model/test_transformer.py::test_keys_major_attention_equals_dot_attention",
    "tests/model/test_transformer.py::test_left_padding_does_not_change_logits",
    "tests/model/test_transformer.py::test_model_gradients_with_plain_attention",
    "tests/model/test_transformer.py::test_projection_backward_equals_autodiff",
    "tests/rl/test_adaptive.py::test_adaptive_steps_shard_like_one_device",
    "tests/rl/test_adaptive.py::test_adaptive_steps_train_and_the_ledger_accounts_for_every_token",
    "tests/rl/test_adaptive.py::test_an_extended_group_equals_the_group_sampled_at_once",
    "tests/rl/test_adaptive.py::test_ledger_sums_for_the_plain_step_with_dynamic_filtering",
    "tests/rl/test_oracle.py::test_oracle_candidates_are_a_uniform_subset_and_counted",
    "tests/rl/test_oracle.py::test_oracle_choose_uses_true_pass_rates_and_counts_its_probes",
    "tests/rl/test_oracle.py::test_probe_is_the_oracle_on_factor_times_n_candidates",
    "tests/sampler/test_paged.py::test_cascade_attention_matches_dense",
    "tests/sampler/test_paged.py::test_cascade_keeps_plain_attention_on_sliding_window_layers",
    "tests/sampler/test_paged.py::test_eight_devices_match_one",
    "tests/sampler/test_paged.py::test_forced_lengths_keep_slots_busy",
    "tests/sampler/test_paged.py::test_greedy_matches_dense",
    "tests/sampler/test_paged.py::test_interpret_kernel_matches_dense",
    "tests/sampler/test_paged.py::test_sampling_matches_dense_with_shared_prompts",
    "tests/sampler/test_paged.py::test_small_pool_waits_and_stays_correct",
    "tests/test_export.py::test_user_path_tokenizer_json",
    "tests/test_lora.py::test_adapters_start_at_the_base_and_unmerged_equals_merged",
    "tests/test_lora.py::test_kl_reference_is_the_base_with_adapters_off",
    "tests/test_lora.py::test_lora_shards_like_one_device",
    "tests/test_lora.py::test_only_adapters_train_and_behaviour_logprobs_equal_the_trainers",
    "tests/test_metrics.py::test_paged_evaluator_matches_dense",
    "tests/test_pass_rate_prior.py::test_prefill_features_ignore_left_padding",
    "tests/test_pipeline.py::test_overlap_equals_the_sequential_one_step_off_reference",
    "tests/test_pipeline.py::test_overlap_with_max_staleness_0_equals_the_sync_step",
    "tests/test_train.py::test_replay_selection_and_length_control_shard_like_one_device",
    "tests/test_train.py::test_trainer_logprobs_equal_sampler_behaviour_logprobs",
    "tests/test_train.py::test_uniform_selection_without_replay_equals_the_plain_grpo_step",
    "tests/test_train.py::test_update_improves_the_objective_on_its_batch",
    "tests/test_update.py::test_fused_pi_old_and_cut_padding_equal_the_plain_update",
    "tests/test_update.py::test_gradient_accumulation_at_equal_widths_equals_the_whole_batch",
    "tests/test_update.py::test_gradient_accumulation_on_the_host_reward_path",
    "tests/test_update.py::test_leaving_out_zero_advantage_rows_changes_nothing",
    "tests/test_update.py::test_length_sorted_micro_batches_equal_the_padded_update",
    "tests/test_update.py::test_row_order_is_one_rule_for_host_and_device",
    # bf16 against f32 (issue 39): each compiles bf16 and f32 rollouts or updates, 8-28 s with
    # --durations at load ~5 on 2 cores; the dtype, copy and decode-loop tests stay fast.
    "tests/test_bf16.py::test_bf16_behaviour_logprobs_match_the_trainers_recomputation",
    "tests/test_bf16.py::test_the_bf16_update_matches_the_f32_one_and_keeps_f32_masters",
    # Fused projections (issue 39): both samplers compiled fused and unfused, 35 s with
    # --durations at load ~4; the fused forward and the HLO counting stay fast.
    "tests/test_decode_kernels.py::test_samplers_draw_the_same_tokens_fused_and_unfused",
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_slow(nodeid: str) -> bool:
  """Whether the test `nodeid` (relative to the repository root) is on the SLOW list."""
  path, _, name = nodeid.partition("::")
  return path in SLOW or f"{path}::{name.split('[')[0]}" in SLOW


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    nodeid = os.path.relpath(str(item.path), REPO).replace(os.sep, "/")
    if "::" in item.nodeid:
      nodeid += "::" + item.nodeid.split("::", 1)[1]
    if is_slow(nodeid):
      item.add_marker(pytest.mark.slow)
