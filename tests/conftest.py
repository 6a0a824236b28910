"""The fast tier: ``pytest -m "not slow"`` runs what is left when the tests in `SLOW` are
marked ``slow`` (docs/testing.md, "The fast tier"). The list is of node-id prefixes as pytest
prints them (a file, or ``file::test`` for every parametrization of one test), chosen from the
durations of a full run (``pytest --durations=0``) so that the rest takes under 4 minutes of
pytest time on a 2-core machine. An entry that names no file, or no test of its file, fails
the collection: the list cannot rot when a test is renamed or moved. The full run (README's
command) still runs everything. The tier keeps its own budget (tests/_fast_tier.py): new
multi-rank tests are slow unless marked fast, and a fast-tier session fails when its tests'
durations, in quiet seconds, exceed the budget."""

from __future__ import annotations

import ast
import pathlib

import pytest

from tests._fast_tier import RECORD, BudgetPlugin, RecordFile, is_fast_tier, launches_ranks

ROOT = pathlib.Path(__file__).resolve().parent.parent

SLOW: list[str] = [  # seconds: setup + call + teardown in the full run of Dec 2026 (loaded 2-core machine)
    'tests/compat/test_checkpoints.py',  # 30 s
    'tests/compat/test_dcp_tutorial.py',  # 4 s
    'tests/compat/test_fsdp_module_api.py::test_custom_collectives_and_reduce_scatter_group',  # 3 s
    'tests/compat/test_fsdp_module_api.py::test_gradient_divide_factor_and_all_reduce_hook',  # 6 s
    'tests/compat/test_fsdp_extensions.py',  # 15 min on a loaded 2-core machine (load 70); torchao, 2-4 ranks a run
    'tests/compat/test_fully_shard_relaxations.py',  # 313 s at load average 30-80 (4 ranks; a few seconds quiet)
    'tests/compat/test_goldens.py::test_regenerating_a_golden_gives_its_file',  # 2 short runs of 4 ranks (torch.compile)
    'tests/compat/test_hsdp_grads.py',  # 2 s
    'tests/compat/test_init_and_apply.py',  # 8 s
    'tests/compat/test_lightning.py',  # shardwise's FSDP and TP flows (torch's: golden data); 27 s for both sides before, load 10
    'tests/compat/test_lightning_trainer.py',  # shardwise's FSDP and TP flows (torch's: golden data); 21 s for both sides before, load 10
    'tests/compat/test_meshes.py',  # 5 s
    'tests/compat/test_ordinary_tensors.py::test_every_case_that_works_on_fsdp2_works_here',  # 170 s for the 5 layouts at high load (2 and 4 workers)
    'tests/compat/test_peft_lora.py',  # 100 s loaded (transformers + peft imported in 2 workers; torch and shardwise)
    'tests/compat/test_setters.py::test_setters_before_and_after_the_first_step',  # 3 s
    'tests/compat/test_torch_compile.py',  # shardwise's three ways (torch's: golden data); 21 s for both sides before, load 10
    'tests/compat/test_torchtitan.py',  # shardwise's FSDP (2 ranks) and FSDP x TP (4) flows (torch's: golden data); 121 s for both sides before, load 10
    'tests/test_compile_fullgraph.py::test_fsdp_whole_model_fullgraph_trains_as_eager_with_the_eager_collectives',  # 193 s at load 25 (explain + 2 compiles, 2 ranks)
    'tests/test_compile_fullgraph.py::test_hsdp_with_mixed_precision_trains_as_eager',  # 102 s at load 25 (4 ranks)
    'tests/test_compile_fullgraph.py::test_inductor_trains_as_eager',  # 167 s at load 25 (inductor's C++ compile)
    'tests/test_compile_fullgraph.py::test_activation_checkpointed_blocks_train_as_eager',  # 49 s at load 25
    'tests/test_compile_fullgraph.py::test_hugging_face_llama_trains_as_eager',  # 224 s at load 25 (transformers)
    'tests/test_compile_fullgraph.py::test_what_cannot_be_traced_is_refused_naming_it',  # 48 s at load 25 (3 traces)
    'tests/compat/test_torchft.py',  # 8 scenario runs of 2 replica groups (1-4 ranks) + a lighthouse; torch's side of 5 is golden: with test_example_ft.py 330 CPU-s (713 s at load 12-43)
    'tests/compat/test_tp_api.py',  # 2 s
    'tests/compat/test_tp_styles.py::test_loss_parallel_reductions_weights_and_a_wrongly_sharded_input',  # 2 s
    'tests/compat/test_torchtitan_forms.py',  # 55 s (16 scenarios on 4 workers)
    'tests/test_checkpoint.py',  # 13 s
    'tests/test_checkpoint_async_process.py',  # each test starts writer processes (import torch): 20-150 s, load average 40-100
    'tests/test_checkpoint_dcp_forms.py',  # 60 s (torch.compile, DDP, DCP, gloo ranks)
    'tests/test_checkpoint_dcp_resharding.py::test_resharding_matches_torch_dcp',  # 180 s loaded
    'tests/test_checkpoint_chunks.py::test_ranks_loading_different_tensors_check_every_chunk_of_both',  # 2 s
    'tests/test_checkpoint_coordination.py::test_every_save_of_the_sequence_round_trips_bit_exact',  # 50 s (the fixture: 13 saves and loads on 2 and 4 ranks)
    'tests/test_checkpoint_coordination.py::test_a_repeated_save_reuses_its_agreement_and_any_change_runs_it_again',
    'tests/test_checkpoint_coordination.py::test_a_reused_save_takes_as_many_collectives_on_4_ranks_as_on_2',
    'tests/test_checkpoint_coordination.py::test_no_rank_but_0_receives_more_than_its_own_share_and_load_has_no_all_gather',
    'tests/test_checkpoint_errors.py::test_bad_input_raises_the_same_clear_error_on_every_rank_and_leaves_the_target',  # 3 s
    'tests/test_checkpoint_fsdp_tp.py',  # 4 s
    'tests/test_checkpoint_hostile_files.py',  # 55 s
    'tests/test_checkpoint_partial_tp.py',  # 3 s
    'tests/test_checkpoint_readers.py',  # 13 s
    'tests/test_checkpoint_s3.py',  # a local S3 server; 1411 s for the two kill sweeps at load average 30-60 (Dec 2)
    'tests/test_checkpoint_series.py',  # 5 s
    'tests/test_checkpoint_tools.py',  # 20 s
    'tests/test_clip_grad.py::test_clip_matches_torch_on_fsdp_and_hsdp',  # 4 s
    'tests/test_cp_attention.py::test_matches_sdpa_fp32',  # 3 s
    'tests/test_cp_hf.py',  # 2 s
    'tests/test_cp_pipeline.py',  # 7 s
    'tests/test_cp_train.py',  # 27 s
    'tests/test_dcp_import.py',  # 30 s
    'tests/test_deferred_init.py::test_meta_init_matches_single_device_bit_for_bit',  # 2 s
    'tests/test_docs_snippets.py',  # 20 s
    'tests/test_dropin_compat.py',  # 4 s
    'tests/test_dropin_compile.py',  # 52 s
    'tests/test_dropin_init.py',  # 49 s
    'tests/test_dropin_meshes.py',  # 24 s
    'tests/test_elastic_agents.py',  # 129 s
    'tests/test_elastic_example.py',  # 5 s
    'tests/test_ep_checkpoint.py',  # 4 s
    'tests/test_ep_fsdp.py',  # 6 s
    'tests/test_ep_hf_merge.py::test_merge_and_hf_folder_write_per_expert_names',  # 2 s
    'tests/test_ep_tp.py',  # 9 s
    'tests/test_example.py',  # 57 s
    'tests/test_example_ft.py',  # 2 torchrun groups of 2 ranks and a lighthouse; 55 s loaded
    'tests/test_example_s3.py',  # 562 s at load average 30-60 (Dec 2); 6 rank runs against a local S3 server
    'tests/test_example_moe.py',  # 20 s
    'tests/test_example_muon.py::test_muon_job_matches_single_process',  # 2 launches (2 and 4 ranks), 150 s loaded
    'tests/test_example_muon.py::test_muon_job_saved_on_four_ranks_resumes_on_two',  # 2 launches, 60 s loaded
    'tests/test_whole_matrix.py::test_same_gradients_bit_equal_to_one_process',  # 6 launches, 40 s loaded
    'tests/test_whole_matrix.py::test_trained_fp32_newton_schulz',  # 3 launches, 40 s loaded
    'tests/test_whole_matrix.py::test_trained_torch_muon_bf16_within_stated_tolerance',  # 10 s loaded
    'tests/test_whole_matrix.py::test_fsdp_x_tp_gathers_over_both_axes',  # 4 ranks with TP, 100 s loaded
    'tests/test_whole_matrix.py::test_one_gather_and_one_scatter_per_bucket',  # 2 launches, 10 s loaded
    'tests/test_whole_matrix.py::test_checkpoint_reshards_4_to_2_bit_exact',  # save on 4, load on 2; 200 s loaded
    'tests/test_expert_parallel.py',  # 5 s
    'tests/test_fsdp2_semantics.py',  # 28 s
    'tests/test_fsdp_tp.py',  # 5 s
    'tests/test_fsdp_tp_llama.py',  # 16 s
    'tests/test_fully_shard.py::test_training_matches_single_process',  # 11 s
    'tests/test_harness.py::test_hung_rank_fails_within_timeout',  # 6 s
    'tests/test_heartbeat.py',  # 7 s
    'tests/test_hf_clients.py',  # 14 s
    'tests/test_hf_folder.py::test_save_hf_folder_from_a_sharded_model_and_merge_of_its_checkpoint',  # 3 s
    'tests/test_hf_folder.py::test_tied_load_into_a_sharded_model',  # 3 s
    'tests/test_memory_tracker.py',  # 6 s
    'tests/test_module_methods.py::test_custom_all_gather_on_uneven_shards',  # 3 s
    'tests/test_no_numpy.py',  # 10 s
    'tests/test_packaging.py',  # 17 s
    'tests/test_peft_lora.py',  # 113 s loaded (transformers + peft imported in 2 workers)
    'tests/test_pipeline.py::test_pp2_x_dp2_x_tp2_on_8_ranks',  # 6 s
    'tests/test_pipeline.py::test_pp2_x_fsdp_accumulates_over_steps_with_gradient_sync_off',  # 3 s
    'tests/test_pipeline.py::test_pp2_x_fsdp_gathers_once_per_unit_per_step',  # 4 s
    'tests/test_pipeline.py::test_pp2_x_fsdp_one_reduce_scatter_per_unit_per_step',  # 2 s
    'tests/test_pipeline.py::test_pp2_x_fsdp_reshard_between_microbatches_and_explicit_setting',  # 4 s
    'tests/test_pipeline.py::test_pp2_x_fsdp_with_activation_checkpointing',  # 2 s
    'tests/test_pipeline.py::test_pp2_x_tp2',  # 2 s
    'tests/test_pipeline_build_time.py',  # one rank forked from the forkserver (the build: 0.15 s of CPU)
    'tests/test_pipeline_checkpoint.py::test_pp2_checkpoint_loads_at_pp1_and_resumes',  # 5 s
    'tests/test_pipeline_hf.py',  # 25 s
    'tests/test_pipeline_mesh_order.py',  # 19 s
    'tests/test_pipeline_pairs.py',  # 9 s
    'tests/test_pipeline_train.py',  # 33 s
    'tests/test_pipeline_transport.py::test_transfers_left_by_a_failed_step_stay_alive',  # 3 s
    'tests/test_pipeline_tuned.py',  # 14 s
    'tests/test_pipeline_zb.py',  # 90 s
    'tests/test_pipeline_zb_pp4.py',  # 7 s
    'tests/test_planner.py::test_suggest_uses_cp_when_activations_do_not_fit_and_before_tp',  # 2 s
    'tests/test_replica_buckets.py',  # 3 s
    'tests/test_save_pretrained.py',  # 5 s
    'tests/test_shard_placement.py',  # 37 s
    'tests/test_state_dict_threads.py',  # 43 s at high load (2 workers, 4 steps twice)
    'tests/test_tp.py',  # 25 s
    'tests/test_tp_llama.py',  # 22 s
    'tests/test_training_backward_error.py',  # 9 s
    'tests/test_training_features.py::test_cpu_offload_on_a_cpu_only_host',  # 3 s
    'tests/test_training_features.py::test_mixed_precision_matches_a_reference_that_casts_the_same_way',  # 4 s
    'tests/test_training_features.py::test_module_reuse_branches_and_activation_checkpointing',  # 7 s
    'tests/test_training_state.py',  # 10 s
    'tests/test_types.py',  # 71 s
    'tests/test_workers.py::test_hung_call_fails_within_its_timeout_with_stacks',  # 3 s
    'tests/test_wrap.py::test_each_strategy_trains_like_one_process',  # 8 s
    # moved out to fit the fast tier's budget (tests/fast_tier.json, quiet seconds, Dec 2026)
    'tests/compat/test_clip_grad_torch.py::test_clip_grad_norm_returns_torchs_dtensor',  # 8.5 s
    'tests/test_checkpoint_index_parts.py::test_the_cli_inspects_and_verifies_a_parted_checkpoint',  # 7.0 s
    'tests/test_dropin_setters.py::test_every_setter_takes_effect',  # 4.5 s
    'tests/test_checkpoint_errors.py::test_kill_during_save_keeps_previous_checkpoint_and_marks_partial',  # 3.5 s
    'tests/test_deferred_init.py::test_broadcast_from_rank0_fills_every_shard',  # 3.3 s
    'tests/test_checkpoint_dcp_api.py::test_process_group_and_no_dist',  # 2.2 s
    'tests/test_cp_layout.py::test_unshard_gives_the_global_sequence',  # 2.0 s
    'tests/test_deferred_init.py::test_a_bad_source_state_dict_is_one_error_on_every_rank',  # 1.9 s
    'tests/test_checkpoint_index_parts.py::test_an_index_in_parts_lists_each_writer_s_part_and_loads_at_every_world_size',  # 1.9 s
]


def _defined(path: pathlib.Path) -> set[str]:
    """The test functions of a file, as ``name`` and ``Class::name``."""
    out: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.ClassDef):
            out.update(f"{node.name}::{f.name}" for f in node.body if isinstance(f, (ast.FunctionDef,
                                                                                    ast.AsyncFunctionDef)))
    return out


def _stale(entries: list[str]) -> list[str]:
    bad = []
    for entry in entries:
        file, _, test = entry.partition("::")
        path = ROOT / file
        if not path.is_file() or (test and test not in _defined(path)):
            bad.append(entry)
    return bad


def _matches(nodeid: str, entry: str) -> bool:
    return nodeid == entry or nodeid.startswith((entry + "::", entry + "["))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    stale = _stale(SLOW)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {stale}")
    recording = config.getoption("fast_tier_record")  # the tier as SLOW leaves it, multi-rank tests included
    recorded = RecordFile.read().durations if RECORD.is_file() and not recording else None
    for item in items:
        if any(_matches(item.nodeid, entry) for entry in SLOW):
            item.add_marker(pytest.mark.slow)
        elif (recorded is not None and item.nodeid not in recorded and not item.get_closest_marker("fast")
              and launches_ranks(item)):
            item.add_marker(pytest.mark.slow)  # a new multi-rank test: slow unless marked fast


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast-tier-record", action="store_true", default=False,
                     help="with -m 'not slow' over tests/: write each test's duration, in quiet seconds, "
                          "to tests/fast_tier.json (tests/_fast_tier.py)")


def pytest_configure(config: pytest.Config) -> None:
    if is_fast_tier(config) or config.getoption("fast_tier_record"):
        record = RecordFile.read() if RECORD.is_file() else None
        config.pluginmanager.register(BudgetPlugin(config, record), "fast-tier-budget")
