"""Guarantees that bite: disable each named mechanism in turn and show that its test fails without it (issue 29).

    python tests/mutation_check.py            # every mechanism (about 5 minutes on a 2-core CPU)
    python tests/mutation_check.py --list     # the mechanisms and their tests
    python tests/mutation_check.py --only rng-restored-on-replay fsdp2-unsharded-grads-cleared

Each mutation replaces one exact snippet of the package's source (or appends code to a module), runs the tests that
guard the mechanism with pytest in a fresh process, and puts the file back (also on Ctrl-C or an error). A mechanism
is **caught** when its tests fail with it disabled; **MISSED** when they pass (the guarantee has no test that bites);
**error** when they error instead (the mutation broke an import, not the mechanism); **stale** when its snippet is
no longer in the source exactly once (update this file with the code). Exit status 0
only when every mechanism is caught. It edits the working tree in place: run it on a clean checkout, and not beside
another test run. CI does not run it (it would add minutes); ``tests/test_mutation_check.py`` keeps its snippets and
test names current.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    """Disable ``name``: in ``path``, ``original`` (exactly once) becomes ``mutated`` (``original`` empty: append
    ``mutated``); ``tests`` (pytest node ids) must then fail."""

    name: str
    guarantee: str
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...]


ELASTIC = "tests/callbacks/test_elastic.py::"
STATE = "tests/callbacks/test_elastic_state.py::"
CONTRACT = "tests/callbacks/test_elastic_contract.py::"
MUTATIONS = (
    Mutation("update-snapshot-restored", "an OOM in an update that creates state replays exactly",
             "autotune/_runtime/microbatch.py", "                self.update.snapshot.restore()\n", "                pass\n",
             (ELASTIC + "test_a_later_update_that_creates_state_is_replayed_exactly",)),
    Mutation("grad-scaler-steps-forgotten", "fp16's GradScaler is right after a replay",
             "autotune/_runtime/microbatch.py",
             "                forget_scaler_steps(scaler)  # forget unscale_/inf checks of the failed attempt\n",
             "                pass\n", (ELASTIC + "test_fp16_grad_scaler_state_is_correct_after_replay",)),
    Mutation("rng-restored-on-replay", "a replay draws the same random numbers (dropout): weights equal native",
             "autotune/_runtime/microbatch.py",
             "            rng.restore()\n            metrics.restore()\n            self._record(",
             "            metrics.restore()\n            self._record(",
             (ELASTIC + "test_oom_at_first_step_replays_and_matches_native_accumulation",)),
    Mutation("metrics-restored-on-replay", "a replay does not count twice in torchmetrics",
             "autotune/_runtime/microbatch.py",
             "            rng.restore()\n            metrics.restore()\n            self._record(",
             "            rng.restore()\n            self._record(",
             (ELASTIC + "test_a_replay_does_not_count_twice_in_torchmetrics",)),
    Mutation("steady-state-copies-nothing", "only updates that create state are copied to the host",
             "autotune/_runtime/state.py",
             "    return any(not state.get(p) and id(p) not in stateless for p in update_parameters(optimizer))\n",
             "    return True\n",
             (ELASTIC + "test_only_updates_that_create_state_are_copied_and_steady_state_copies_nothing",)),
    Mutation("fsdp2-unsharded-grads-cleared", "an OOM inside an FSDP2 unit's backward replays exactly",
             "autotune/_runtime/drain.py", "            clear_fsdp_unsharded_grads(unit)\n", "            pass\n",
             ("tests/callbacks/test_elastic_fsdp.py::"
              "test_an_oom_inside_a_units_backward_after_some_of_its_gradients_is_replayed_exactly",)),
    Mutation("shape-growth-capped", "a longer batch is never tried beyond twice what ran",
             "autotune/_runtime/shapes.py", "            if load > self.growth * lo:\n", "            if False:\n",
             ("tests/callbacks/test_elastic_shapes.py::"
              "test_a_longer_batch_is_never_tried_beyond_twice_what_ran_under_any_possible_cost",)),
    Mutation("private-api-only-in-compat", "only _compat.py reaches into private upstream API",
             "autotune/_runtime/events.py", "",
             "\n\ndef _peek(trainer):\n    return trainer.fit_loop._data_fetcher\n",
             ("tests/test_layout.py::test_only_compat_reaches_into_private_upstream_api",)),
    Mutation("offload-keeps-stochastic-rounding", "optimizer offload under bf16-true runs torchao's rounding update",
             "autotune/_runtime/offload.py", '    own = getattr(optimizer, "update_constructor", None)\n',
             "    own = None\n",
             ("tests/callbacks/test_apply_plan.py::"
              "test_optimizer_offload_under_bf16_true_keeps_the_stochastic_rounding",)),
    Mutation("estimate-reads-values-fallback", "a step that reads tensor values is estimated (real tensors)",
             "autotune/_estimate/trace.py", "                raise _ReadsValues(text, detail) from error\n",
             "                raise ValueError(text) from error\n",
             ("tests/test_estimate_reads_values.py::test_a_mixture_of_experts_with_data_dependent_routing_is_"
              "estimated",)),
    Mutation("estimate-keeps-user-rng", "the estimator's real path leaves the user's random state alone",
             "autotune/_estimate/trace.py",
             "        rng = _kept_random_state() if self.real else contextlib.nullcontext()",
             "        rng = contextlib.nullcontext()",
             ("tests/test_estimate_reads_values.py::"
              "test_the_real_path_leaves_the_model_and_the_random_state_alone",)),
    Mutation("estimate-every-parameter-updated", "the real path's answer does not depend on what was traced before",
             "autotune/_estimate/trace.py",
             "                if p.requires_grad and p.grad is None:\n                    p.grad = torch.zeros_like(p)\n",
             "                if False:\n                    pass\n",
             ("tests/test_estimate_reads_values.py::"
              "test_routing_that_leaves_experts_idle_gives_the_same_answer_whatever_was_traced_before",)),
    Mutation("estimate-line-as-the-step-runs", "the line from micro-batches 2 and 4 meets the direct trace",
             "autotune/_estimate/trace.py", "        accumulate = micro < self.size\n        one, two",
             "        accumulate = True\n        one, two",
             ("tests/test_estimate_reads_values.py::test_larger_micro_batches_lie_on_the_line_of_two_smaller_ones",)),
    Mutation("estimate-fits-settled-by-a-run", "autotune estimate's 'fits' agrees with a measured run near the budget",
             "autotune/_cli/main.py", "SETTLE_BAND = 0.05\n", "SETTLE_BAND = -1.0\n",
             ("tests/test_estimate.py::test_a_cpu_row_near_the_budget_is_settled_by_a_short_run",)),
    Mutation("search-estimates-the-largest-batch", "auto micro-batches hold for the longest batch of varying lengths",
             "autotune/_search/memory.py", "self._batch, self.batch_sizes = longest_batch(self.target)",
             "self._batch, self.batch_sizes = longest_batch(self.target, batches=1)",
             ("tests/test_search_shapes.py::test_the_search_estimates_on_the_largest_batch",)),
    Mutation("trials-run-the-longest-batch", "a trial's peak covers the longest batch the search read",
             "autotune/_search/search.py", "stop_below=stop_below, long_batch=self._long_batch())",
             "stop_below=stop_below, long_batch=None)",
             ("tests/test_search_shapes.py::test_each_trial_runs_the_longest_batch_so_a_plan_that_cannot_hold_it_is_"
              "infeasible",)),
    Mutation("soft-budget-peak-rides-on-the-vote", "a soft budget under DDP/FSDP2 adds no collective per step",
             "autotune/_runtime/microbatch.py",
             "        deferred = soft and not grow_due and self.agree.enabled and not shapes.agreed\n",
             "        deferred = False\n",
             ("tests/callbacks/test_elastic_ddp.py::test_a_soft_budget_under_ddp_adds_no_collective_and_ranks_shrink_"
              "alike",
              "tests/callbacks/test_elastic_fsdp.py::test_a_soft_budget_under_fsdp2_adds_no_collective_and_ranks_shrink_"
              "alike")),
    Mutation("search-peak-noise-is-not-a-fit", "a plan within its peak's noise of the budget is not chosen",
             "autotune/_search/choose.py",
             "        if over_budget_by(max(p or 0 for p in peaks), peak_noise(runs), budget_bytes) > 0:\n",
             "        if False:\n",
             ("tests/test_search_choice.py::test_a_plan_within_its_peak_s_noise_of_the_budget_is_not_chosen",)),
    Mutation("search-edge-leader-measured-again", "a leader measured once on the budget's edge is measured again",
             "autotune/_search/choose.py",
             "        edge = len(lead.runs) == 1 and lead.peak_bytes > (1 - EDGE_SHARE) * budget_bytes\n",
             "        edge = False\n",
             ("tests/test_search_choice.py::test_a_leader_on_the_budget_s_edge_is_measured_again_and_dropped_if_a_run_"
              "is_over",)),
    Mutation("oneDNN-conv-buffers-measured", "a CPU estimate counts the buffers oneDNN convolutions hold (ConvNeXt)",
             "autotune/_estimate/workspace.py", " or _onednn_conv(func, args))", ")",
             ("tests/test_clients.py::test_a_client_model_s_cpu_estimate_is_within_the_published_accuracy"
              "[convnext-none]",)),
    Mutation("cuda-cap-is-the-limit", "without a budget, a CUDA cap set before fit is the limit the runtime works to",
             "callbacks/elastic.py",
             "            return None, min(probe.total_bytes, int(fraction * torch.cuda.mem_get_info(device)[1]))\n",
             "            return None, probe.total_bytes\n",
             (ELASTIC + "test_without_a_budget_a_cuda_cap_set_before_fit_is_the_limit",)),
    Mutation("cuda-meter-reads-nested-stats", "the CUDA meter does not flatten the allocator's statistics each step",
             "autotune/_device/meter.py", '            return cuda_stat(self.device, "reserved_bytes", "peak")\n',
             "            return torch.cuda.max_memory_reserved(self.device)\n",
             ("tests/test_probe.py::test_the_cuda_meter_reads_the_figures_torch_s_own_helpers_read",)),
    Mutation("auto-out-of-memory-halved", "an 'auto' micro-batch that runs out of memory is tried again at half",
             "autotune/_search/search.py",
             '        if result.status == "oom":\n            self._auto_ran_out(trial, params, plan.micro_batch_size)\n',
             '        if result.status == "oom":\n            pass\n',
             ("tests/test_search_auto.py::"
              "test_an_auto_micro_batch_that_runs_out_of_memory_is_halved_and_tried_again",)),
    Mutation("auto-out-of-memory-halved-from-cache", "a resumed search halves an 'auto' whose OOM it finds cached",
             "autotune/_search/search.py",
             "            if result.status == \"oom\" and measured:  # a resumed search meets its earlier 'auto' that "
             "ran out\n                self._auto_ran_out(trial, params, plan.micro_batch_size)\n",
             "            if result.status == \"oom\" and measured:  # a resumed search meets its earlier 'auto' that "
             "ran out\n                pass\n",
             ("tests/test_search_auto.py::test_a_resumed_search_meets_its_earlier_out_of_memory_auto_in_the_cache_"
              "and_halves_from_there",)),
    Mutation("cuda-trials-calibrate", "on CUDA a measured trial corrects its shape's 'auto' (context, fragmentation)",
             "autotune/_search/memory.py", '        traced only then."""\n        if lazily',
             '        traced only then."""\n        if self.device.type == "cuda":\n            return False\n'
             '        if lazily',
             ("tests/test_search_choice.py::"
              "test_on_cuda_auto_starts_from_the_context_and_learns_each_shapes_gap_from_its_trials",)),
    Mutation("cuda-split-learns-tensors", "on CUDA the shape model and growth learn from the tensors' peak, not the "
             "allocator's cached reserve", "autotune/_runtime/microbatch.py",
             "        peak, load = self.meter.peaks() if self._measure else (0, 0)  # the budget's measure, the "
             "tensors' (CUDA)\n",
             "        peak, load = self.meter.peaks() if self._measure else (0, 0)\n        load = peak\n",
             ("tests/callbacks/test_elastic_shapes.py::"
              "test_on_cuda_the_shape_model_learns_from_the_tensors_peak_not_the_allocators_cache",
              "tests/callbacks/test_elastic_shapes.py::"
              "test_on_cuda_a_fixed_shape_grows_from_the_tensors_peak_not_the_allocators_cache")),
    Mutation("per-sample-lists-cut", "a per-sample list (a target tensor or dict per image, NumPy ids) is cut with its "
             "micro-batch", "autotune/_runtime/batch.py",
             "        return items[start:stop] if _is_per_sample(items, size, first) else None\n",
             "        return None\n",
             ("tests/callbacks/test_batch.py::test_per_sample_lists_of_any_kind_are_cut",
              ELASTIC + "test_batch_structures[lists]")),
    Mutation("logged-batch-size-is-the-samples", "epoch means weigh a step by the samples of the micro-batches that "
             "logged", "autotune/_runtime/logbuffer.py",
             "                    weights, arguments[\"batch_size\"] = _weights(calls)\n",
             "                    weights = _weights(calls)[0]\n",
             (STATE + "test_epoch_means_weigh_each_step_by_the_samples_that_logged",)),
    Mutation("unseen-update-not-replayed", "an OOM in the steady-state update of an optimizer whose changes version "
             "counters may not see is not replayed", "autotune/_runtime/state.py",
             "    if not _counts_its_changes(optimizer):\n", "    if False:\n",
             (STATE + "test_an_update_oom_of_an_optimizer_whose_changes_cannot_be_seen_is_not_replayed",)),
    Mutation("measured-bytes-rule-out-costs", "bytes measured at several lengths rule out the costs they contradict",
             "autotune/_runtime/shapes.py", "            if len({p.s for p in measured}) >= 2 and bounds:\n",
             "            if False:\n",
             ("tests/callbacks/test_elastic_shapes.py::"
              "test_bytes_measured_at_several_lengths_rule_out_the_costs_they_contradict",
              "tests/callbacks/test_elastic_shapes.py::"
              "test_the_h200_real_memory_run_played_splits_near_the_fewest_micro_batches[161]")),
    Mutation("shape-model-learns-before-the-update", "the shape model learns what grows with the micro-batch, not "
             "the update's peak", "autotune/_runtime/microbatch.py",
             "            if self._measure and self._byte_limit() is not None:\n", "            if False:\n",
             ("tests/callbacks/test_elastic_shapes.py::"
              "test_the_h200_real_memory_run_played_splits_near_the_fewest_micro_batches[400]",)),
    Mutation("cuda-context-measured", "on CUDA a shape not measured starts from the context a trial measured",
             "autotune/_search/memory.py", "        if first or context_bytes < self.baseline:\n", "        if False:\n",
             ("tests/test_search_context.py::"
              "test_on_cuda_the_context_a_trial_measured_replaces_the_estimate_for_shapes_not_measured",)),
    Mutation("search-learns-cuda-context", "a CUDA search's trials give the estimator the context they measured",
             "autotune/_search/search.py", "            self.estimator.measured_context(result.context_bytes)\n",
             "            pass\n",
             ("tests/test_search_context.py::"
              "test_a_cuda_search_learns_the_context_from_its_trials_and_from_a_resumed_study",)),
    Mutation("norm-running-stats-restored", "a failed attempt leaves no trace in BatchNorm's running statistics",
             "autotune/_runtime/state.py", "        self.running.restore()\n", "        pass\n",
             (STATE + "test_a_failed_attempt_leaves_no_trace_in_batchnorm_running_statistics",)),
    Mutation("update-prepared-once-per-attempt", "L-BFGS: the host copy is taken before the first closure evaluation",
             "autotune/_runtime/update.py", "        if self._prepared:\n            return\n", "",
             (CONTRACT + "test_lbfgs_recovers_from_an_oom_in_any_closure_evaluation",)),
    Mutation("zero-grad-hooks-once", "on_before_zero_grad runs once per step, not per micro-batch or replay",
             "autotune/_runtime/microbatch.py", "            if evaluation in self._zeroed:\n",
             "            if False:\n",
             (CONTRACT + "test_on_before_zero_grad_runs_once_per_step_and_not_again_on_a_replay",)),
    Mutation("step-outputs-combined", "on_train_batch_end gets the whole batch's outputs",
             "autotune/_runtime/microbatch.py", "            if len(extras) > 1 and all(extra for extra, _ in extras):",
             "            if False:",
             (CONTRACT + "test_training_step_outputs_are_those_of_the_whole_batch",)),
    Mutation("stateless-parameters-steady", "a stateless optimizer's steady updates copy nothing",
             "autotune/_runtime/update.py", "if not state.get(p))\n", "if not state.get(p) and False)\n",
             (CONTRACT + "test_a_stateless_update_is_copied_once_and_an_lbfgs_update_every_step",)),
    Mutation("per-sample-outputs-concatenated", "a split evaluation's per-sample outputs come back whole and in order",
             "autotune/_runtime/batch.py",
             "        if _is_per_sample(first, sizes[0], None) and all(", "        if False and all(",
             (CONTRACT + "test_per_sample_prediction_lists_come_back_whole_and_in_order_after_a_split",)),
    Mutation("lists-give-the-batch-size", "a batch without tensors is split by its per-sample lists",
             "autotune/_runtime/batch.py", "    return None if items is None else len(items)\n",
             "    return None\n",
             (CONTRACT + "test_a_batch_without_tensors_is_split_by_its_per_sample_lists",)),
    Mutation("norm-stats-kept-in-recompute", "a checkpointed block's recompute does not count in BatchNorm's stats",
             "autotune/_runtime/blocks.py",
             '            contexts = {"context_fn": functools.partial(_recompute_keeping_stats, norms)} if norms else {}\n',
             "            contexts = {}\n",
             ("tests/test_clients.py::test_a_client_model_trains_the_same_with_checkpointing_and_activation_offload",)),
    Mutation("checkpoint-wrapper-bound-to-its-block", "a copy of a checkpointed model computes with its own weights",
             "autotune/_runtime/blocks.py",
             "        bound = isinstance(original, types.MethodType) and original.__self__ is block\n",
             "        bound = False\n",
             ("tests/callbacks/test_apply_plan.py::test_a_copy_of_a_checkpointed_model_computes_with_its_own_weights",)),
    Mutation("encoder-and-decoder-layers-join", "an encoder-decoder's two kinds of layer are both checkpointed",
             "autotune/_runtime/blocks.py", "        if (authors or cls in stacked) and all(",
             "        if not authors and cls in stacked and all(",
             ("tests/test_clients.py::test_an_encoder_decoder_s_two_kinds_of_layer_are_both_blocks",)),
    Mutation("step-work-recompute-phase", "the step-time model counts checkpointing's recomputation apart",
             "autotune/_estimate/work.py",
             '        phase = "recompute" if self.phase == "backward" and torch.is_grad_enabled() else self.phase\n',
             "        phase = self.phase\n",
             ("tests/test_step_time.py::test_the_flops_of_a_known_step_are_counted_exactly_by_phase",)),
    Mutation("step-time-host-link", "offloaded activations cost host-link time, more over a slower link",
             "autotune/_estimate/step_time.py",
             '            self.parts["host link"] += moved / device.host_link_bandwidth\n',
             "            pass\n", ("tests/test_step_time.py::test_what_if_rankings_whose_order_is_certain",)),
    Mutation("calibration-per-bound", "trials of known efficiencies give them back, bound by bound",
             "autotune/_estimate/calibration.py",
             "    u = np.clip(np.linalg.solve(lhs, rhs), 1 / LIMIT, LIMIT)\n", "    u = np.ones(len(used))\n",
             ("tests/test_step_time_calibration.py::test_trials_of_known_efficiencies_give_them_back",)),
    Mutation("search-stops-within-the-models-error", "the search stops only when no plan can win by the model's error",
             "autotune/_search/confirm.py",
             "            if predicted is None or predicted.samples_per_second * margin >= best:\n",
             "            if predicted is None or predicted.samples_per_second >= best:\n",
             ("tests/test_search_confirm.py::"
              "test_the_search_stops_once_no_unmeasured_plan_can_beat_the_best_by_the_models_error",)),
)


def check(m: Mutation) -> str | None:
    """Why ``m`` cannot be applied (its snippet is not in its file exactly once), or None."""
    path = ROOT / m.path
    if not path.is_file():
        return f"{m.path} does not exist"
    if m.original and path.read_text().count(m.original) != 1:
        return f"its snippet is in {m.path} {path.read_text().count(m.original)} times, not once"
    for test in m.tests:
        file, _, name = test.partition("::")
        name = name.partition("[")[0]  # a parametrized case: its function
        if not (ROOT / file).is_file() or f"def {name}(" not in (ROOT / file).read_text():
            return f"test {test} does not exist"
    return None


def run(m: Mutation, timeout: float) -> tuple[str, float]:
    """Apply ``m``, run its tests, restore the file: ``caught``, ``MISSED``, ``error``, ``stale`` or ``timed out``."""
    if check(m) is not None:
        return "stale", 0.0
    path = ROOT / m.path
    source = path.read_text()
    path.write_text(source.replace(m.original, m.mutated, 1) if m.original else source + m.mutated)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        # a test failing (an assertion) catches it; an error (import, collection) is a broken mutation
        status = "MISSED" if done.returncode == 0 else "caught" if " failed" in last and " error" not in last \
            else "error"
    except subprocess.TimeoutExpired:
        status = "timed out"
    finally:
        path.write_text(source)
    return status, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the mechanisms and their tests, run nothing")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mechanisms")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mechanism's tests (default 300)")
    args = parser.parse_args(argv)
    names = {m.name for m in MUTATIONS}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        print(f"mutation_check: unknown mechanism {', '.join(unknown)}; known: {', '.join(sorted(names))}",
              file=sys.stderr)
        return 2
    chosen = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.guarantee}\n    {m.path}\n    " + "\n    ".join(m.tests))
        return 0
    results = []
    for m in chosen:
        status, seconds = run(m, args.timeout)
        results.append(status)
        print(f"{status:>9}  {seconds:5.1f} s  {m.name}: {m.guarantee}", flush=True)
    caught = results.count("caught")
    print(f"{caught} of {len(results)} mechanisms caught by their tests")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
