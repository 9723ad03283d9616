"""Guarantees that bite: disable each named mechanism in turn and show that its test fails without it.

    python tests/mutation_check.py            # every mechanism (several minutes on a 2-core CPU)
    python tests/mutation_check.py --list     # the mechanisms, where they live and their tests
    python tests/mutation_check.py --only rng-restored-on-replay fsdp2-unsharded-grads-cleared

A mechanism is found by name, not by a copy of its source: a module, a function in it (``Class.method``, or a
function nested in another: ``outer.inner``; empty: the module itself) and a change written against the code's
syntax tree, such as "drop the calls of ``rng.restore``", "the test of the ``if`` that reads ``self.growth`` is
False", "``own`` is assigned ``None``". Code that is reformatted, moved within its function or commented keeps its
mutation; one whose function or named piece is gone is **stale**. Each mutation rewrites its module (from its syntax
tree, so comments and layout are lost for the run), runs the tests that guard the mechanism with pytest in a fresh
process, and puts the file back (also on Ctrl-C or an error). A mechanism is **caught** when its tests fail with it
disabled; **MISSED** when they pass; **error** when they error instead (the mutation broke an import). Exit status 0
only when every mechanism is caught. It edits the working tree in place: run it on a clean checkout, and not beside
another test run. CI does not run it (it would add minutes); ``tests/test_mutation_check.py`` keeps every mutation
applicable and its tests existing.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------- changes
def dotted(node: ast.AST) -> str:
    """``a.b.c`` for a name or attribute chain (calls and subscripts in it stand as ``()`` and ``[]``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return f"{dotted(node.func)}()"
    if isinstance(node, ast.Subscript):
        return f"{dotted(node.value)}[]"
    return ""


def names(name: str, node: ast.AST) -> bool:
    """Whether ``node``'s dotted name is ``name`` or ends with ``.name``."""
    text = dotted(node)
    return text == name or text.endswith("." + name)


def mentions(node: ast.AST, name: str) -> bool:
    """Whether ``name`` (a dotted name) appears anywhere in ``node``."""
    return any(names(name, n) for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute)))


def expression(code: str) -> ast.expr:
    return ast.parse(code, mode="eval").body


def drop_statements(node: ast.AST, matches: Callable[[ast.stmt], bool]) -> int:
    """Every statement under ``node`` that ``matches`` becomes ``pass``; how many did."""
    count = 0
    for parent in ast.walk(node):
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(parent, field, None)
            if not isinstance(statements, list):
                continue
            for i, statement in enumerate(statements):
                if matches(statement):
                    statements[i] = ast.Pass()
                    count += 1
    return count


@dataclass(frozen=True)
class Skip:
    """Every call of ``callee`` made as a statement is dropped."""

    callee: str

    def apply(self, node: ast.AST) -> int:
        return drop_statements(node, lambda s: isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                               and names(self.callee, s.value.func))


@dataclass(frozen=True)
class Calls:
    """Every call of ``callee`` becomes ``expr``."""

    callee: str
    expr: str

    def apply(self, node: ast.AST) -> int:
        change = self

        class Swap(ast.NodeTransformer):
            count = 0

            def visit_Call(self, call: ast.Call) -> ast.AST:
                self.generic_visit(call)
                if names(change.callee, call.func):
                    self.count += 1
                    return expression(change.expr)
                return call

        swap = Swap()
        swap.visit(node)
        return swap.count


@dataclass(frozen=True)
class FalseTest:
    """The test of every ``if``, ``elif``, ``while`` and conditional expression that reads ``name`` is False."""

    name: str

    def apply(self, node: ast.AST) -> int:
        count = 0
        for n in ast.walk(node):
            if isinstance(n, (ast.If, ast.While, ast.IfExp)) and mentions(n.test, self.name):
                n.test = ast.Constant(False)
                count += 1
        return count


@dataclass(frozen=True)
class Assign:
    """Every assignment to ``target`` (its source, as ``ast.unparse`` writes it) assigns ``expr`` instead."""

    target: str
    expr: str

    def apply(self, node: ast.AST) -> int:
        count = 0
        for n in ast.walk(node):
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and \
                    ast.unparse(n.targets[0]).strip("()") == self.target:
                n.value = expression(self.expr)
                count += 1
        return count


@dataclass(frozen=True)
class Drop:
    """Every augmented assignment to ``target`` (``target += ...``, its source as ``ast.unparse`` writes it) is
    dropped."""

    target: str

    def apply(self, node: ast.AST) -> int:
        return drop_statements(node, lambda s: isinstance(s, ast.AugAssign) and ast.unparse(s.target) == self.target)


@dataclass(frozen=True)
class Keyword:
    """The keyword argument ``name`` of every call is ``expr``."""

    name: str
    expr: str

    def apply(self, node: ast.AST) -> int:
        count = 0
        for n in ast.walk(node):
            if isinstance(n, ast.Call):
                for keyword in n.keywords:
                    if keyword.arg == self.name:
                        keyword.value = expression(self.expr)
                        count += 1
        return count


@dataclass(frozen=True)
class Returns:
    """Every ``return`` that reads ``name`` returns ``expr`` instead (``name`` empty: the function's whole body is
    ``return expr``, its docstring kept)."""

    name: str
    expr: str

    def apply(self, node: ast.AST) -> int:
        if not self.name:
            docstring = node.body[:1] if ast.get_docstring(node) is not None else []  # type: ignore[attr-defined]
            node.body = [*docstring, ast.Return(expression(self.expr))]  # type: ignore[attr-defined]
            return 1
        count = 0
        for n in ast.walk(node):
            if isinstance(n, ast.Return) and n.value is not None and mentions(n.value, self.name):
                n.value = expression(self.expr)
                count += 1
        return count


@dataclass(frozen=True)
class Prepend:
    """``code`` runs first in the function (after its docstring)."""

    code: str

    def apply(self, node: ast.AST) -> int:
        at = 1 if ast.get_docstring(node) is not None else 0  # type: ignore[arg-type]
        node.body[at:at] = ast.parse(self.code).body  # type: ignore[attr-defined]
        return 1


@dataclass(frozen=True)
class Append:
    """``code`` is added at the end of the module."""

    code: str

    def apply(self, node: ast.AST) -> int:
        node.body.extend(ast.parse(self.code).body)  # type: ignore[attr-defined]
        return 1


Change = Skip | Calls | FalseTest | Assign | Drop | Keyword | Returns | Prepend | Append


@dataclass(frozen=True)
class Mutation:
    """Disable ``name``: in module ``path``, inside ``where`` (a function, ``Class.method``, ``outer.inner``; empty:
    the module), apply ``change``; ``tests`` (pytest node ids) must then fail."""

    name: str
    guarantee: str
    path: str
    where: str
    change: Change
    tests: tuple[str, ...]


def find(tree: ast.Module, where: str) -> ast.AST | None:
    """The class or function ``where`` names in ``tree`` (the module itself for an empty name)."""
    node: ast.AST = tree
    for part in [p for p in where.split(".") if p]:
        found = None
        for n in ast.walk(node):
            if n is not node and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    n.name == part:
                found = n
                break
        if found is None:
            return None
        node = found
    return node


def mutated(m: Mutation) -> str | None:
    """The module's source with ``m`` applied, or None when it does not apply (its function or piece is gone)."""
    path = ROOT / m.path
    if not path.is_file():
        return None
    tree = ast.parse(path.read_text())
    node = find(tree, m.where)
    if node is None or m.change.apply(node) == 0:
        return None
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


# --------------------------------------------------------------------------------------------------- mutations
RUNTIME = "autotune/_runtime/"
TRANSFORMS = "autotune/_transforms/"
ELASTIC = "tests/runtime/test_replay.py::"
STATE = "tests/runtime/test_state_restored.py::"
CONTRACT = "tests/runtime/test_lightning_contract.py::"
SHAPES = "tests/runtime/test_shapes.py::"
DIFFER = "tests/runtime/test_ranks_differ.py::"
POLICY = "tests/runtime/test_policy.py::"
RECOMPUTE = "tests/estimate/test_recompute.py::"
ENGINE = "ElasticEngine.run_training_step"
TARGET_FAILURE = "tests/search/test_target_failure.py::"
CLI_ONE_LINE = ("tests/callbacks/test_lightning_cli.py::"
                "test_a_cut_tuned_file_a_setup_check_and_a_misspelt_key_are_one_line_under_lightning_cli")
MUTATIONS = (
    Mutation("update-snapshot-restored", "an OOM in an update that creates state replays exactly",
             RUNTIME + "microbatch.py", ENGINE, Skip("update.snapshot.restore"),
             (ELASTIC + "test_a_later_update_that_creates_state_is_replayed_exactly",)),
    Mutation("grad-scaler-steps-forgotten", "fp16's GradScaler is right after a replay",
             RUNTIME + "microbatch.py", ENGINE, Skip("forget_scaler_steps"),
             (ELASTIC + "test_fp16_grad_scaler_state_is_correct_after_replay",)),
    Mutation("rng-restored-on-replay", "a replay draws the same random numbers (dropout): weights equal native",
             RUNTIME + "microbatch.py", ENGINE, Skip("rng.restore"),
             (ELASTIC + "test_oom_at_first_step_replays_and_matches_native_accumulation",)),
    Mutation("metrics-restored-on-replay", "a replay does not count twice in torchmetrics",
             RUNTIME + "state.py", "MetricStates.restore", Skip("setattr"),
             (ELASTIC + "test_a_replay_does_not_count_twice_in_torchmetrics",)),
    Mutation("buffers-restored-on-replay", "a failed attempt leaves no trace in BatchNorm's statistics or a buffer the "
             "forward updates", RUNTIME + "state.py", "MetricStates.restore", Skip("buffers.restore"),
             (STATE + "test_a_failed_attempt_leaves_no_trace_in_batchnorm_running_statistics",)),
    Mutation("buffers-compared-by-value", "buffers changed by kernels that bump no version counter are copied",
             RUNTIME + "state.py", "BufferStates._note_changes", Calls("torch.equal", "True"),
             (STATE + "test_a_buffer_changed_without_a_version_bump_is_put_back_after_a_failed_attempt",)),
    Mutation("steady-state-copies-nothing", "only updates that create state are copied to the host",
             RUNTIME + "state.py", "creates_state", Returns("", "True"),
             (ELASTIC + "test_only_updates_that_create_state_are_copied_and_steady_state_copies_nothing",)),
    Mutation("fsdp2-unsharded-grads-cleared", "an OOM inside an FSDP2 unit's backward replays exactly",
             RUNTIME + "drain.py", "CollectiveDrain.reset", Skip("clear_fsdp_unsharded_grads"),
             ("tests/runtime/test_fsdp.py::"
              "test_an_oom_inside_a_units_backward_after_some_of_its_gradients_is_replayed_exactly",)),
    Mutation("shape-growth-capped", "a longer batch is never tried beyond twice what ran",
             RUNTIME + "shapes.py", "ShapeModel._fit_probability", FalseTest("self.growth"),
             (SHAPES + "test_a_longer_batch_is_never_tried_beyond_twice_what_ran_under_any_possible_cost",)),
    Mutation("probe-tries-what-evidence-allows", "a batch just under a learned boundary is tried whole when growing "
             "is due", RUNTIME + "shapes.py", "ShapeModel.choose", Assign("allowed", "chance >= q"),
             (SHAPES + "test_a_rank_whose_batches_sit_just_under_a_learned_boundary_tries_them_whole_when_growing_"
                       "is_due",)),
    Mutation("peer-oom-keeps-this-ranks-split", "another rank's OOM makes a rank replay, not shrink",
             RUNTIME + "policy.py", "MicroBatchPolicy.after_oom", FalseTest("own"),
             (POLICY + "test_its_own_oom_halves_and_another_ranks_changes_nothing",
              DIFFER + "test_a_rank_whose_micro_batch_fits_is_not_shrunk_by_its_peers_ooms")),
    Mutation("soft-budget-failed-grow-waits-longer", "a grow that goes over a soft budget doubles the wait, as a "
             "failed grow does", RUNTIME + "policy.py", "MicroBatchPolicy._over_budget", FalseTest("grew"),
             (POLICY + "test_a_grow_that_goes_over_a_soft_budget_doubles_the_wait_as_a_failed_grow_does",)),
    Mutation("ddp-buffers-broadcast-each-step", "DDP's buffers are broadcast once per step, as in Lightning's "
             "accumulation", RUNTIME + "sync.py", "DDPBuffers.before_attempt", Skip("sync_ddp_buffers"),
             (DIFFER + "test_ranks_that_differ_end_exact[2]", DIFFER + "test_ranks_that_differ_end_exact[3]")),
    Mutation("ddp-no-broadcast-inside-micro-batches", "a failed forward leaves no DDP buffer broadcast due on one "
             "rank", RUNTIME + "sync.py", "DDPBuffers.before_attempt", Skip("set_ddp_buffers_due"),
             (DIFFER + "test_ranks_that_differ_end_exact[0]",)),
    Mutation("guard-before-the-models-collectives", "a rank that failed meets its peers before a collective of "
             "the model's", RUNTIME + "guard.py", "CollectiveGuard._wrap.guarded", Skip("before"),
             (DIFFER + "test_ranks_that_differ_end_exact[4]",)),
    Mutation("counts-agree-after-collectives", "ranks whose model makes collectives run equal counts",
             RUNTIME + "microbatch.py", "ElasticEngine._vote", FalseTest("verdict.collectives"),
             (DIFFER + "test_ranks_that_differ_end_exact[4]",)),
    Mutation("equal-sizes-where-counts-agree", "ranks that run equal counts run equal sizes (a collective that "
             "follows the micro-batch agrees)", RUNTIME + "microbatch.py", "ElasticEngine._agreed_split",
             Assign("even", "False"),
             (DIFFER + "test_a_collective_that_follows_the_micro_batch_meets_equal_sizes_on_every_rank",)),
    Mutation("ddp-static-graph-and-comm-hook-refused", "a DDP module's static graph or communication hook is refused, "
             "not bypassed", "callbacks/_checks.py", "check_ddp_model", Returns("", "None"),
             ("tests/runtime/test_ddp_settings.py::test_a_ddp_setting_the_runtime_cannot_honour_is_refused_naming_the_fix",)),
    Mutation("hooks-once-per-step", "on_before_optimizer_step runs once per step, not again on a replay after an OOM "
             "in the update", RUNTIME + "microbatch.py", "ElasticEngine.hooks_due", Returns("", "True"),
             (ELASTIC + "test_hooks_and_clipping_run_once_per_step_after_an_oom_in_the_first_update",)),
    Mutation("per-rank-state-in-checkpoint", "every rank resumes with its own micro-batch and shape model",
             RUNTIME + "checkpoint.py", "own", Prepend("return {}"),
             ("tests/runtime/test_state_restored.py::test_every_rank_resumes_with_its_own_state",)),
    Mutation("vote-after-an-oom-before-the-closure", "an OOM in an optimizer pre-hook meets its peers in the vote",
             RUNTIME + "microbatch.py", "ElasticEngine._failure_of", Calls("self._vote", "self._local(failure)"),
             (DIFFER + "test_ranks_that_differ_end_exact[7]",)),
    Mutation("private-api-only-in-compat", "only _compat/ reaches into private upstream API",
             RUNTIME + "events.py", "", Append("def _peek(trainer):\n    return trainer.fit_loop._data_fetcher\n"),
             ("tests/test_layout.py::test_only_compat_reaches_into_private_upstream_api",)),
    Mutation("offload-keeps-stochastic-rounding", "optimizer offload under bf16-true runs torchao's rounding update",
             TRANSFORMS + "offload.py", "update_constructor", Assign("own", "None"),
             ("tests/callbacks/test_apply_plan.py::"
              "test_optimizer_offload_under_bf16_true_keeps_the_stochastic_rounding",)),
    Mutation("estimate-reads-values-fallback", "a step the trace without data cannot follow is estimated (real "
             "tensors)", "autotune/_estimate/trace.py", "_trace", Calls("_FakeFailed", "ValueError(text)"),
             ("tests/estimate/test_reads_values.py::test_a_mixture_of_experts_with_data_dependent_routing_is_"
              "estimated",
              "tests/estimate/test_reads_values.py::test_any_failure_of_the_trace_without_data_goes_to_real_tensors_"
              "and_says_why")),
    Mutation("estimate-extrapolates-each-moment", "a micro-batch extrapolated follows each moment of the step, not the "
             "line through two peaks", "autotune/_estimate/real_path.py", "_on_lines", Returns("", "False"),
             ("tests/estimate/test_reads_values.py::test_larger_micro_batches_follow_each_moment_of_two_smaller_ones",)),
    Mutation("estimate-real-path-limits", "a micro-batch whose work is too much for the host is extrapolated",
             "autotune/_estimate/real_path.py", "choose", Assign("why", "None"),
             ("tests/estimate/test_reads_values.py::test_the_work_of_micro_batches_1_and_2_decides_what_is_traced",
              "tests/estimate/test_reads_values.py::test_a_micro_batch_whose_work_passes_the_limits_is_extrapolated")),
    Mutation("estimate-names-inert-settings", "checkpointing layers whose own forward never runs is named, and the "
             "search drops it", "autotune/_estimate/inert.py", "Watch.inert", FalseTest("self._ran"),
             ("tests/estimate/test_inert.py::test_checkpointing_layers_whose_own_forward_never_runs_is_named",
              "tests/estimate/test_inert.py::test_the_search_s_space_loses_the_choices_that_do_nothing_for_its_target")),
    Mutation("estimate-grouped-mm-fp32", "transformers' mixtures of experts in fp32 are traced without data",
             "autotune/_estimate/fake_rules.py", "allow_grouped_mm_in_any_dtype", Skip("register_grouped_mm_fake"),
             ("tests/estimate/test_clients.py::test_a_client_model_s_cpu_estimate_is_within_the_published_accuracy"
              "[mixtral-none]",)),
    Mutation("estimate-keeps-user-rng", "the estimator's real path leaves the user's random state alone",
             "autotune/_estimate/fake_model.py", "FakeStep.entered", Assign("rng", "contextlib.nullcontext()"),
             ("tests/estimate/test_reads_values.py::"
              "test_the_real_path_leaves_the_model_and_the_random_state_alone",)),
    Mutation("estimate-every-parameter-updated", "the real path's answer does not depend on what was traced before",
             "autotune/_estimate/fake_model.py", "FakeStep.fill_grads", FalseTest("p.requires_grad"),
             ("tests/estimate/test_reads_values.py::"
              "test_routing_that_leaves_experts_idle_gives_the_same_answer_whatever_was_traced_before",)),
    Mutation("estimate-line-as-the-step-runs", "the line from micro-batches 2 and 4 meets the direct trace",
             "autotune/_estimate/trace.py", "Traces._traced_real", Assign("accumulate", "True"),
             ("tests/estimate/test_reads_values.py::test_larger_micro_batches_follow_each_moment_of_two_smaller_"
              "ones",)),
    Mutation("estimate-fits-settled-by-a-run", "autotune estimate's 'fits' agrees with a measured run near the budget",
             "autotune/_cli/estimate.py", "", Assign("SETTLE_BAND", "-1.0"),
             ("tests/estimate/test_estimate.py::test_a_cpu_row_near_the_budget_is_settled_by_a_short_run",)),
    Mutation("search-estimates-the-largest-batch", "auto micro-batches hold for the longest batch of varying lengths",
             "autotune/_search/memory.py", "SearchEstimator._call", Calls("longest_batch",
                                                                          "longest_batch(self.target, batches=1)"),
             ("tests/search/test_shapes.py::test_the_search_estimates_on_the_largest_batch",)),
    Mutation("trials-run-the-longest-batch", "a trial's peak covers the longest batch the search read",
             "autotune/_search/objective.py", "Objective._spec", Keyword("long_batch", "None"),
             ("tests/search/test_shapes.py::test_each_trial_runs_the_longest_batch_so_a_plan_that_cannot_hold_it_is_"
              "infeasible",)),
    Mutation("soft-budget-shrink-gives-the-heap-back", "a step over a CPU budget halves once, not down to the minimum",
             RUNTIME + "microbatch.py", ENGINE, Skip("release_host_memory"),
             (ELASTIC + "test_a_cpu_soft_budget_overshoot_shrinks_once_not_down_to_the_minimum",)),
    Mutation("search-edge-is-a-cost", "a plan whose peak's noise reaches the budget is ranked by its expected speed",
             "autotune/_search/figures.py", "figures", Keyword("overflow_chance", "0.0"),
             ("tests/search/test_edge.py::test_the_edge_is_a_cost_that_a_safer_plan_can_beat",)),
    Mutation("search-over-the-budget-does-not-fit", "a plan with a run whose every step was over does not fit",
             "autotune/_search/figures.py", "figures", Calls("over_budget_by", "0"),
             ("tests/search/test_edge.py::test_a_plan_whose_every_step_was_over_the_budget_overflows_often_and_does_"
              "not_fit", "tests/search/test_choice.py::test_a_plan_over_the_budget_in_a_second_run_is_not_chosen")),
    Mutation("search-paired-verdict", "the leader is replaced by a rival only as its paired comparison says",
             "autotune/_search/choose.py", "choose", Assign("champion", "lead.trial"),
             ("tests/search/test_paired.py::test_a_neighbour_coming_and_going_does_not_decide_the_choice",
              "tests/search/test_choice.py::test_a_contender_within_reach_is_compared_in_pairs_and_its_ratio_"
              "decides")),
    Mutation("search-paired-rounds-alternate", "a paired round runs its two plans in alternating order",
             "autotune/_search/paired.py", "paired_rounds", Assign("order", "((0, run_a), (1, run_b))"),
             ("tests/search/test_paired.py::test_a_round_runs_both_plans_back_to_back_in_alternating_order_and_"
              "stops_once_clear",)),
    Mutation("search-paired-reruns-unlike-loads", "a round whose runs met unlike loads is run again",
             "autotune/_search/paired.py", "paired_rounds", Calls("load_differs", "False"),
             ("tests/search/test_paired.py::test_a_round_whose_two_runs_met_unlike_loads_is_run_again",)),
    Mutation("search-work-wins-only-when-faster", "a plan that adds work replaces a simpler one only when faster "
             "beyond noise", "autotune/_search/choose.py", "_verdict", Calls("ratio.slower", "ratio.ratio < 1"),
             ("tests/search/test_paired.py::test_a_plan_that_adds_work_wins_only_when_its_paired_ratio_says_it_is_"
              "faster",)),
    Mutation("search-stopped-simpler-plan-compared", "a trial stopped early on a busy host is compared in pairs",
             "autotune/_search/choose.py", "_stopped_early", Returns("out", "[]"),
             ("tests/search/test_simplest.py::test_the_issue_s_busy_host_chooses_the_plain_plan_over_checkpointing_"
              "within_noise",
              "tests/search/test_simplest.py::test_a_stopped_plan_clear_of_the_leader_and_no_simpler_is_not_measured_"
              "again")),
    Mutation("trial-stops-on-its-interval", "a trial is stopped as too slow on its interval, not on a few slow steps",
             "autotune/_search/meter.py", "Meter._decide", FalseTest("MIN_TIMED"),
             ("tests/search/test_choice.py::test_a_run_is_stopped_as_too_slow_on_its_interval_never_on_a_few_slow_"
              "steps",)),
    Mutation("search-measures-the-leader-s-plain-twin", "a plan adding a feature is measured against its plain twin",
             "autotune/_search/twin.py", "measure_twin", Skip("study.enqueue_trial"),
             ("tests/search/test_simplest.py::test_the_leader_s_plain_twin_is_measured_once_before_choosing",)),
    Mutation("search-walks-halving-s-ladder", "where halving finds a micro-batch that fits, the search finds a plan",
             "autotune/_search/search.py", "_run_trials", Skip("walk_ladder"),
             ("tests/search/test_halving.py::test_a_search_whose_trials_all_run_out_finds_the_plan_halving_finds",)),
    Mutation("search-first-trials-cover-each-precision", "the first trials measure each precision's predicted best",
             "autotune/_search/confirm.py", "predicted_best_first", Assign("ordered", "guided[:1] + seeds + guided[1:]"),
             ("tests/search/test_model_learns.py::test_the_first_trials_measure_each_precision_s_predicted_best_after_"
              "the_predicted_best",)),
    Mutation("search-model-corrected-by-setting", "the model's error by setting is fitted from the study's trials",
             "autotune/_search/residuals.py", "Corrections.factor", Returns("", "1.0"),
             ("tests/search/test_model_learns.py::test_corrections_follow_the_setting_the_model_misprices_and_leave_"
              "the_rest",)),
    Mutation("search-contradicted-model-re-ranks", "queued first trials are re-ranked once the model is contradicted",
             "autotune/_search/confirm.py", "contradiction", Returns("", "None"),
             ("tests/search/test_model_learns.py::test_a_contradicted_model_s_queued_first_trials_are_re_ranked_by_"
              "what_the_trials_taught_it",)),
    Mutation("search-contradiction-covers-each-precision", "points queued after a contradiction cover each precision",
             "autotune/_search/search.py", "_unmeasured", Assign("covering", "[]"),
             ("tests/search/test_model_learns.py::test_points_queued_after_a_contradiction_cover_each_precision_"
              "before_the_overall_ranking",)),
    Mutation("search-requeued-point-keeps-going", "a point queued once the model was contradicted keeps the search on",
             "autotune/_search/confirm.py", "StopWhenConfirmed.__call__", FalseTest("GUIDED"),
             ("tests/search/test_confirm.py::test_a_point_queued_once_the_model_was_contradicted_keeps_the_search_"
              "going",)),
    Mutation("search-contradiction-keeps-the-trial-count", "a contradiction queues no more than the trials left",
             "autotune/_search/confirm.py", "FollowWhatIsMeasured.__call__", FalseTest("self.room"),
             ("tests/search/test_model_learns.py::test_a_contradiction_with_nothing_queued_queues_no_more_than_the_"
              "trials_left",)),
    Mutation("search-unmeasured-precision-keeps-going", "a queued trial of an unmeasured precision keeps the search on",
             "autotune/_search/confirm.py", "StopWhenConfirmed.__call__", Assign("precisions", "{None, 'bf16-mixed'}"),
             ("tests/search/test_confirm.py::test_a_queued_trial_of_a_precision_no_trial_measured_keeps_the_search_"
              "going",)),
    Mutation("load-counts-the-run-s-own-tree", "a run's own processes' CPU is its own, others' its neighbours'",
             "autotune/_device/load.py", "_own_cpu_seconds", Assign("procs", "[parent]"),
             ("tests/device/test_load.py::test_a_spinning_child_is_this_run_s_own_work_and_another_process_a_"
              "neighbour",)),
    Mutation("trials-wait-passively", "the trial server starts with OpenMP waiting passively",
             "autotune/_search/trial.py", "_passive_wait", Assign("os.environ['OMP_WAIT_POLICY']", "'ACTIVE'"),
             ("tests/search/test_paired.py::test_the_trial_server_starts_with_passive_waiting_unless_the_user_set_a_"
              "policy",)),
    Mutation("search-fits-by-a-run-s-peak", "a plan fits when its run's projected peak does, not its trial's",
             "autotune/_search/figures.py", "run_peak",
             Returns("", "(int(run.get('peak_bytes') or 0), run.get('peak_noise_bytes'))"),
             ("tests/search/test_growth.py::test_a_plan_whose_trial_fits_but_whose_run_would_not_does_not_fit_and_"
              "halving_goes_on",)),
    Mutation("run-peak-carries-the-creep", "a trial's creeping step peaks are carried to a run's length",
             "autotune/_search/growth.py", "run_peak_of", Assign("projected", "top + offset"),
             ("tests/search/test_growth.py::test_a_trial_whose_steps_creep_is_projected_over_the_run_not_held_at_its_"
              "own_peak",)),
    Mutation("cpu-baseline-grows-with-the-micro-batch", "shapes not measured take the default shape's baseline line",
             "autotune/_search/memory.py", "SearchEstimator._baseline_at", Assign("default", "None"),
             ("tests/estimate/test_process_peak.py::test_the_cpu_process_peak_of_plans_not_measured_is_within_10_"
              "percent_of_a_trial_s",)),
    Mutation("search-workers-skip-a-peer-s-comparison", "a comparison a peer worker stored ends this worker's",
             "autotune/_search/paired.py", "compare", Calls("stored_ratio", "None"),
             ("tests/search/test_choice.py::test_workers_choosing_at_once_keep_each_others_runs_and_do_not_repeat_"
              "them", "tests/search/test_paired.py::test_a_stored_comparison_is_reused_by_a_rerun_or_another_worker")),
    Mutation("search-workers-keep-each-other-s-runs", "workers choosing at once keep each other's re-measurements",
             "autotune/_search/figures.py", "add_remeasured",
             Calls("study.set_user_attr", "study.set_user_attr(f'{REMEASURED}:{trial}:0', run)"),
             ("tests/search/test_choice.py::test_workers_choosing_at_once_keep_each_others_runs_and_do_not_repeat_"
              "them",)),
    Mutation("search-edge-leader-measured-again", "a leader measured once on the budget's edge is measured again",
             "autotune/_search/choose.py", "choose", Skip("add_remeasured"),
             ("tests/search/test_choice.py::test_a_leader_on_the_budget_s_edge_is_measured_again_and_dropped_if_a_run_"
              "is_over",)),
    Mutation("oneDNN-conv-buffers-measured", "a CPU estimate counts the buffers oneDNN convolutions hold (ConvNeXt)",
             "autotune/_estimate/workspace.py", "Workspace.bytes_of", Calls("_onednn_conv", "False"),
             ("tests/estimate/test_clients.py::test_a_client_model_s_cpu_estimate_is_within_the_published_accuracy"
              "[convnext-none]",)),
    Mutation("cuda-cap-is-the-limit", "without a budget, a CUDA cap set before fit is the limit the runtime works to",
             "callbacks/elastic.py", "ElasticBatchSize._resolve_budget",
             Returns("torch.cuda.mem_get_info", "(None, probe.total_bytes)"),
             (ELASTIC + "test_without_a_budget_a_cuda_cap_set_before_fit_is_the_limit",)),
    Mutation("trial-capped-at-the-search-s-bytes", "a trial caps its memory at the bytes the search resolved and "
             "judges it against, not at a resolution of its own", "callbacks/elastic.py",
             "ElasticBatchSize._resolve_budget", Calls("resolve_budget", "resolve_budget(self.budget, device)"),
             ("tests/device/test_budget.py::test_a_trial_is_capped_at_the_bytes_the_search_resolved_not_at_a_reading_of_its_"
              "own",)),
    Mutation("over-device-budget-refused", "the estimate, the search and the callback refuse a budget over the "
             "device's memory, in one sentence", "autotune/_device/budget.py", "resolve_budget",
             FalseTest("budget_bytes"),
             ("tests/device/test_budget.py::test_the_estimate_the_search_and_the_callback_refuse_a_budget_over_the_device_in_"
              "one_sentence",)),
    Mutation("cuda-meter-reads-nested-stats", "the CUDA meter does not flatten the allocator's statistics each step",
             "autotune/_device/meter.py", "MemoryMeter.peak",
             Returns("cuda_stat", "torch.cuda.max_memory_reserved(self.device)"),
             ("tests/device/test_probe.py::test_the_cuda_meter_reads_the_figures_torch_s_own_helpers_read",)),
    Mutation("auto-out-of-memory-halved", "an 'auto' micro-batch that runs out of memory is tried again at half, "
             "also when a resumed search finds its OOM cached", "autotune/_search/objective.py", "Objective._run",
             Skip("self._auto_ran_out"),
             ("tests/search/test_auto.py::"
              "test_an_auto_micro_batch_that_runs_out_of_memory_is_halved_and_tried_again",
              "tests/search/test_auto.py::test_a_resumed_search_meets_its_earlier_out_of_memory_auto_in_the_cache_"
              "and_halves_from_there")),
    Mutation("cuda-trials-calibrate", "on CUDA a measured trial corrects its shape's 'auto' (context, fragmentation)",
             "autotune/_search/memory.py", "SearchEstimator.calibrate",
             Prepend("if self.device.type == 'cuda':\n    return False"),
             ("tests/search/test_choice.py::"
              "test_on_cuda_auto_starts_from_the_context_and_learns_each_shapes_gap_from_its_trials",)),
    Mutation("cuda-split-learns-tensors", "on CUDA the shape model and growth learn from the tensors' peak, not the "
             "allocator's cached reserve", RUNTIME + "microbatch.py", "ElasticEngine._peaks",
             Assign("grows", "peak"),
             (SHAPES + "test_on_cuda_the_shape_model_learns_from_the_tensors_peak_not_the_allocators_cache",)),
    Mutation("per-sample-lists-cut", "a per-sample list (a target tensor or dict per image, NumPy ids) is cut with its "
             "micro-batch", RUNTIME + "batch.py", "slice_batch.per_sample", Calls("_is_per_sample", "False"),
             ("tests/runtime/test_batch.py::test_per_sample_lists_of_any_kind_are_cut",
              ELASTIC + "test_batch_structures[lists]")),
    Mutation("logged-batch-size-is-the-samples", "epoch means weigh a step by the samples of the micro-batches that "
             "logged", RUNTIME + "logbuffer.py", "LogBuffer.flush",
             Assign("weights, arguments['batch_size']", "(_weights(calls)[0], arguments.get('batch_size'))"),
             (STATE + "test_epoch_means_weigh_each_step_by_the_samples_that_logged",)),
    Mutation("unseen-update-not-replayed", "an OOM in the steady-state update of an optimizer whose changes version "
             "counters may not see is not replayed", RUNTIME + "state.py", "update_fingerprint",
             FalseTest("_counts_its_changes"),
             (STATE + "test_an_update_oom_of_an_optimizer_whose_changes_cannot_be_seen_is_not_replayed",)),
    Mutation("measured-bytes-rule-out-costs", "bytes measured at several lengths rule out the costs they contradict",
             RUNTIME + "shapes.py", "ShapeModel._compute_bounds", FalseTest("bounds"),
             (SHAPES + "test_bytes_measured_at_several_lengths_rule_out_the_costs_they_contradict",
              SHAPES + "test_the_h200_real_memory_run_played_splits_near_the_fewest_micro_batches[161]")),
    Mutation("shape-model-learns-before-the-update", "the shape model learns what grows with the micro-batch, not "
             "the update's peak", RUNTIME + "microbatch.py", "ElasticEngine._multi_closure.run_micro_batches",
             FalseTest("self.policy.memory.limit_bytes"),
             (SHAPES + "test_the_h200_real_memory_run_played_splits_near_the_fewest_micro_batches[400]",)),
    Mutation("cuda-context-measured", "on CUDA a shape not measured starts from the context a trial measured",
             "autotune/_search/memory.py", "SearchEstimator.measured_context", FalseTest("self.baseline"),
             ("tests/search/test_context.py::"
              "test_on_cuda_the_context_a_trial_measured_replaces_the_estimate_for_shapes_not_measured",)),
    Mutation("search-learns-cuda-context", "a CUDA search's trials give the estimator the context they measured",
             "autotune/_search/objective.py", "Objective._run", Skip("self.estimator.measured_context"),
             ("tests/search/test_context.py::"
              "test_a_cuda_search_learns_the_context_from_its_trials_and_from_a_resumed_study",)),
    Mutation("update-prepared-once-per-attempt", "L-BFGS: the host copy is taken before the first closure evaluation",
             RUNTIME + "update.py", "UpdateGuard.prepare", FalseTest("self._prepared"),
             (CONTRACT + "test_lbfgs_recovers_from_an_oom_in_any_closure_evaluation",)),
    Mutation("zero-grad-hooks-once", "on_before_zero_grad runs once per step, not per micro-batch or replay",
             RUNTIME + "microbatch.py", "ElasticEngine._zero_grad_once.zero_grad", FalseTest("self._zeroed"),
             (CONTRACT + "test_on_before_zero_grad_runs_once_per_step_and_not_again_on_a_replay",)),
    Mutation("step-outputs-combined", "on_train_batch_end gets the whole batch's outputs",
             RUNTIME + "microbatch.py", "ElasticEngine._multi_closure.run_micro_batches", FalseTest("extras"),
             (CONTRACT + "test_training_step_outputs_are_those_of_the_whole_batch",)),
    Mutation("stateless-parameters-steady", "a stateless optimizer's steady updates copy nothing",
             RUNTIME + "update.py", "UpdateGuard.succeeded", Skip("self._stateless.update"),
             (CONTRACT + "test_a_stateless_update_is_copied_once_and_an_lbfgs_update_every_step",)),
    Mutation("per-sample-outputs-concatenated", "a split evaluation's per-sample outputs come back whole and in order",
             RUNTIME + "batch.py", "combine_outputs", FalseTest("_is_per_sample"),
             (CONTRACT + "test_per_sample_prediction_lists_come_back_whole_and_in_order_after_a_split",)),
    Mutation("lists-give-the-batch-size", "a batch without tensors is split by its per-sample lists",
             RUNTIME + "batch.py", "batch_size_of", Returns("items", "None"),
             (CONTRACT + "test_a_batch_without_tensors_is_split_by_its_per_sample_lists",)),
    Mutation("norm-stats-kept-in-recompute", "a checkpointed block's recompute does not count in BatchNorm's stats",
             TRANSFORMS + "blocks.py", "forward", Assign("contexts", "{}"),
             ("tests/estimate/test_clients.py::test_a_client_model_trains_the_same_with_checkpointing_and_activation_offload",)),
    Mutation("checkpoint-wrapper-bound-to-its-block", "a copy of a checkpointed model computes with its own weights",
             TRANSFORMS + "blocks.py", "checkpoint_blocks", Assign("bound", "False"),
             ("tests/callbacks/test_apply_plan.py::test_a_copy_of_a_checkpointed_model_computes_with_its_own_weights",)),
    Mutation("encoder-and-decoder-layers-join", "an encoder-decoder's two kinds of layer are both checkpointed",
             TRANSFORMS + "blocks.py", "find_blocks", FalseTest("authors"),
             ("tests/estimate/test_clients.py::test_an_encoder_decoder_s_two_kinds_of_layer_are_both_blocks",)),
    Mutation("tuned-file-lists-callbacks-first", "a bad value anywhere in a tuned file is one line under LightningCLI",
             "autotune/_plan/plan.py", "Plan.tuned_document",
             Returns("ELASTIC", "{'trainer': {**trainer, 'callbacks+': [{'class_path': ELASTIC, 'init_args': "
                                "self.elastic_kwargs()}, {'class_path': APPLY, 'init_args': apply}]}}"),
             ("tests/callbacks/test_lightning_cli.py::test_each_bad_value_under_lightning_cli_is_at_most_three_lines",)),
    Mutation("cli-errors-read-the-config-files", "a bad value refused while parsing is one line under LightningCLI",
             "callbacks/_lightning_cli.py", "_parse_error.error", Assign("problems", "[]"),
             ("tests/callbacks/test_lightning_cli.py::test_each_bad_value_under_lightning_cli_is_at_most_three_lines",)),
    Mutation("dash-values-attached", "`--budget -1GiB` gets our budget message, not argparse's",
             "autotune/_cli/main.py", "main", Calls("_attach_dash_values", "argv"),
             ("tests/cli/test_cli.py::test_a_value_that_starts_with_a_dash_gets_our_message_not_argparses",)),
    Mutation("step-work-recompute-phase", "the step-time model counts checkpointing's recomputation apart",
             "autotune/_estimate/work.py", "WorkCounter.record", Assign("phase", "self.phase"),
             ("tests/estimate/test_step_time.py::test_the_flops_of_a_known_step_are_counted_exactly_by_phase",)),
    Mutation("step-time-host-link", "offloaded activations cost host-link time, more over a slower link",
             "autotune/_estimate/step_time.py", "_Accumulator.add", Drop("self.parts['host link']"),
             ("tests/estimate/test_step_time.py::test_what_if_rankings_whose_order_is_certain",)),
    Mutation("calibration-per-bound", "trials of known efficiencies give them back, bound by bound",
             "autotune/_estimate/calibration.py", "fit_efficiency", Assign("u", "np.ones(len(used))"),
             ("tests/estimate/test_step_time_calibration.py::test_trials_of_known_efficiencies_give_them_back",)),
    Mutation("search-stops-within-the-models-error", "the search stops only when no plan can win by the model's error",
             "autotune/_search/confirm.py", "StopWhenConfirmed.__call__", Assign("margin", "1"),
             ("tests/search/test_confirm.py::"
              "test_the_search_stops_once_no_unmeasured_plan_can_beat_the_best_by_the_models_error",)),
    Mutation("target-failure-stops-the-estimator", "the target's own code failing in the estimator's read or trace "
             "stops the search", "autotune/_search/memory.py", "SearchEstimator._call", FalseTest("failure"),
             (TARGET_FAILURE + "test_the_estimator_stops_on_the_targets_failure_and_notes_one_plans_alone",)),
    Mutation("plain-step-decides-a-plans-failure", "a failure of one plan's trace alone is a note, not a stop",
             "autotune/_search/memory.py", "SearchEstimator._target_failure", Skip("self.tensors"),
             (TARGET_FAILURE + "test_the_estimator_stops_on_the_targets_failure_and_notes_one_plans_alone",)),
    Mutation("short-first-run-stops-on-target-code", "the CPU short first run failing in the target's code stops the "
             "search", "autotune/_search/memory.py", "SearchEstimator.measure_baseline", FalseTest("target_error"),
             (TARGET_FAILURE + "test_a_failure_the_estimator_cannot_see_is_caught_by_the_short_first_run",)),
    Mutation("same-failure-in-two-plans-stops", "two plans' trials failing at one line of the target's code stop the "
             "search", "autotune/_search/stopping.py", "StopOnFailures.__call__", FalseTest("last"),
             (TARGET_FAILURE + "test_a_failure_the_first_run_does_not_reach_stops_after_two_plans_fail_alike_and_"
                               "resumes_after_the_fix",)),
    Mutation("tuned-file-whole-or-refused", "a tuned file missing a key is refused", "autotune/_plan/tuned.py",
             "_collect_fields", Calls("missing_keys", "[]"),
             ("tests/plan/test_plan.py::test_a_tuned_file_missing_any_key_is_refused_in_one_line_naming_it",
              "tests/plan/test_plan.py::test_a_tuned_file_cut_short_anywhere_is_refused")),
    Mutation("tuned-plan-does-not-grow", "a tuned plan trains at its measured micro-batch", "autotune/_plan/plan.py",
             "Plan.elastic_kwargs", Returns("budget", "{'budget': self.budget, 'micro_batch_size': "
                                                      "self.micro_batch_size, 'micro_batch_sample_size': "
                                                      "self.micro_batch_sample_size, 'grow': True}"),
             ("tests/plan/test_plan.py::test_a_tuned_plan_trains_at_its_measured_micro_batch_unless_the_file_says_grow",)),
    Mutation("cut-tuned-file-refused-under-lightning-cli", "a tuned file that parses but is not whole is refused under "
             "LightningCLI", "callbacks/_lightning_cli.py", "_checked_instantiation.instantiate",
             FalseTest("problems"), (CLI_ONE_LINE,)),
    Mutation("setup-checks-one-line-under-lightning-cli", "our callbacks' setup checks are one line under LightningCLI",
             "callbacks/_lightning_cli.py", "_excepthook.excepthook", FalseTest("_our_check"), (CLI_ONE_LINE,)),
    Mutation("argparse-errors-one-line", "a bad argument is one line, not argparse's usage", "autotune/_cli/main.py",
             "_Parser.error", Prepend("super().error(message)"),
             ("tests/cli/test_cli.py::test_an_argument_argparse_refuses_is_one_line_with_what_is_accepted",)),
    Mutation("recompute-ops-saves-products", "an 'ops' block saves its matrix products: its peak is what the estimate "
             "of the choice says", TRANSFORMS + "recompute.py", "save_products",
             Returns("", "CheckpointPolicy.PREFER_RECOMPUTE"),
             (RECOMPUTE + "test_the_choice_fits_the_budget_and_its_estimate_on_cpu_and_is_minimal",)),
    Mutation("recompute-choice-pruned", "the auto choice is minimal: no block recomputes more than the budget needs",
             "autotune/_estimate/recompute.py", "_pruned", Returns("", "levels"),
             (RECOMPUTE + "test_pruning_takes_down_what_the_greedy_took_needlessly_dearest_first",)),
    Mutation("recompute-attention-dropout-recomputed", "attention with dropout recomputes under 'ops', so the random "
             "state stays in order: weights equal no checkpointing", TRANSFORMS + "recompute.py", "save_products",
             FalseTest("_dropout"),
             (RECOMPUTE + "test_the_ops_policy_saves_products_and_attention_without_dropout_and_recomputes_the_rest",)),
    Mutation("search-keeps-the-auto-choice", "a search's trial of an auto point records what it chose, which "
             "the tuned file writes", "autotune/_search/objective.py", "Objective._run", Assign("chosen", "None"),
             (RECOMPUTE + "test_a_search_runs_what_auto_chose_and_writes_it",)),
    Mutation("first-run-without-third-party-noise", "the README's first run prints no tip or deprecation warning",
             "autotune/_compat/lightning.py", "quiet_third_party_notices", Returns("", "None"),
             ("tests/e2e/test_docs.py::test_doc_commands_run[README.md]",)),
)


def check(m: Mutation) -> str | None:
    """Why ``m`` cannot be applied (its module, function or piece is gone, or a test), or None."""
    if not (ROOT / m.path).is_file():
        return f"{m.path} does not exist"
    if mutated(m) is None:
        where = f"{m.where} of {m.path}" if m.where else m.path
        return f"{m.change} changes nothing in {where} (or it is gone)"
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
    path.write_text(mutated(m) or source)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0",
                               *m.tests], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
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
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per mechanism's tests (default 420)")
    args = parser.parse_args(argv)
    known = {m.name for m in MUTATIONS}
    unknown = sorted(set(args.only or ()) - known)
    if unknown:
        print(f"mutation_check: unknown mechanism {', '.join(unknown)}; known: {', '.join(sorted(known))}",
              file=sys.stderr)
        return 2
    chosen = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.guarantee}\n    {m.path}: {m.where or '(module)'}: {m.change}\n    "
                  + "\n    ".join(m.tests))
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
