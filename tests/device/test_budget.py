import dataclasses
import math
import pickle
from typing import Any

import pytest

from autotune._device.budget import Budget, format_bytes, resolve_budget

GIB = 2**30
MIB = 2**20
TOTAL = 80 * GIB
FREE = 60 * GIB
ACCEPTED = r"budget must be bytes like '20GiB', '512MiB' or 4294967296, a fraction of total memory in \(0, 1\]"


@pytest.mark.parametrize(
    ("spec", "expected_bytes", "text"),
    [
        ("20GiB", 20 * GIB, "20GiB"),
        ("20GB", 20 * 10**9, "20GB"),
        ("512MiB", 512 * MIB, "512MiB"),
        ("1.5GiB", 3 * GIB // 2, "1.5GiB"),
        ("100KB", 100_000, "100KB"),
        ("4096B", 4096, "4096B"),
        ("4096", 4096, "4096"),
        ("2KiB", 2048, "2KiB"),
        ("3MB", 3_000_000, "3MB"),
        ("2TB", 2 * 10**12, "2TB"),
        ("1TiB", 2**40, "1TiB"),
        ("20 gib", 20 * GIB, "20GiB"),  # unit case and the space are free; the text is canonical
        ("20gb", 20 * 10**9, "20GB"),
        ("1.50 GiB", 3 * GIB // 2, "1.5GiB"),
        ("1.1MiB", 1_153_433, "1.1MiB"),  # 1153433.6 bytes, rounded down
        ("  8GiB\n", 8 * GIB, "8GiB"),
        (4_294_967_296, 4 * GIB, "4294967296"),
        (1, 1, "1"),  # an int is always bytes
    ],
)
def test_byte_specs_resolve_to_exact_bytes(spec, expected_bytes, text):
    budget = Budget.parse(spec)
    assert budget.kind == "bytes"
    assert budget.value == expected_bytes
    assert budget.resolve(total_bytes=TOTAL, free_bytes=FREE) == expected_bytes
    assert str(budget) == budget.text == text


@pytest.mark.parametrize(
    ("spec", "fraction", "text"),
    [(0.8, 0.8, "0.8"), ("0.8", 0.8, "0.8"), (1.0, 1.0, "1.0"), ("1.0", 1.0, "1.0"), (".25", 0.25, "0.25")],
)
def test_fraction_specs_resolve_to_share_of_total(spec, fraction, text):
    budget = Budget.parse(spec)
    assert budget.kind == "fraction"
    assert budget.value == fraction
    assert budget.resolve(total_bytes=TOTAL, free_bytes=FREE) == int(fraction * TOTAL)
    assert str(budget) == text


def test_fraction_of_total_is_exact_bytes():
    assert Budget.parse(0.5).resolve(total_bytes=8 * GIB, free_bytes=GIB) == 4 * GIB
    assert Budget.parse("1.0").resolve(total_bytes=TOTAL, free_bytes=0) == TOTAL


@pytest.mark.parametrize("spec", ["auto", "AUTO", " auto ", "Auto"])
def test_auto_is_free_memory_minus_margin(spec):
    budget = Budget.parse(spec)
    assert budget.kind == "auto"
    assert budget.value is None
    assert str(budget) == "auto"
    # 5% of 80 GiB (4 GiB) is above the 512 MiB floor.
    assert budget.resolve(total_bytes=TOTAL, free_bytes=FREE) == FREE - 4 * GIB


def test_auto_margin_is_at_least_512_mib():
    # 5% of 4 GiB is 204.8 MiB, so the 512 MiB floor applies.
    assert Budget.margin_bytes(total_bytes=4 * GIB) == 512 * MIB
    assert Budget.parse("auto").resolve(total_bytes=4 * GIB, free_bytes=3 * GIB) == 3 * GIB - 512 * MIB
    assert Budget.margin_bytes(total_bytes=100 * GIB) == 5 * GIB


def test_auto_without_room_for_the_margin_names_free_memory():
    with pytest.raises(ValueError, match=r"budget 'auto' leaves no memory: free memory is 400.00 MiB"):
        Budget.parse("auto").resolve(total_bytes=4 * GIB, free_bytes=400 * MIB)
    with pytest.raises(ValueError, match=r"free memory is 512.00 MiB \(536870912 bytes\), at or below"):
        Budget.parse("auto").resolve(total_bytes=4 * GIB, free_bytes=512 * MIB)


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        ("20XB", "'20XB'"),
        ("-1GiB", "'-1GiB'"),
        (0, "0"),
        (-5, "-5"),
        (1.5, "1.5"),
        ("1.5", "'1.5'"),
        (0.0, "0.0"),
        ("0", "'0'"),
        ("0.0", "'0.0'"),
        ("0GiB", "'0GiB'"),
        ("0.0001B", "'0.0001B'"),  # rounds down to zero bytes
        (True, "True"),
        (False, "False"),
        ("", "''"),
        ("   ", "'   '"),
        (None, "None"),
        (math.nan, "nan"),
        (math.inf, "inf"),
        ("nan", "'nan'"),
        ("1e9", "'1e9'"),
        ("20 GiB extra", "'20 GiB extra'"),
        ("GiB", "'GiB'"),
        ("20G", "'20G'"),
        ("4_096", "'4_096'"),
        ("autox", "'autox'"),
        (4096.0, "4096.0"),  # a float is a fraction, never bytes
        ([20], r"\[20\]"),
    ],
)
def test_bad_specs_name_the_value_and_the_accepted_forms(spec, shown):
    with pytest.raises(ValueError, match=rf"^{ACCEPTED} like 0\.8, or 'auto'; got {shown}$"):
        Budget.parse(spec)


def test_error_message_is_one_line():
    with pytest.raises(ValueError, match="got '20\\\\nGiB'$") as info:
        Budget.parse("20\nGiB")
    assert "\n" not in str(info.value)


def test_parse_returns_a_budget_unchanged():
    budget = Budget.parse("20GiB")
    assert Budget.parse(budget) is budget


@pytest.mark.parametrize("spec", ["20GiB", "20 gb", "1.5GiB", "4096", 4096, 0.8, "1.0", 1.0, " AUTO ", "1.1MiB"])
def test_text_parses_back_to_the_same_budget(spec):
    budget = Budget.parse(spec)
    again = Budget.parse(str(budget))
    assert again == budget
    assert again.value == budget.value
    assert again.kind == budget.kind


def test_equal_budgets_compare_equal_across_spellings():
    assert Budget.parse("20GiB") == Budget.parse(20 * GIB)
    assert Budget.parse("0.5") == Budget.parse(0.5)
    assert Budget.parse("1GB") != Budget.parse("1GiB")


def test_budget_is_frozen():
    budget = Budget.parse("20GiB")
    with pytest.raises(AttributeError, match="cannot assign to field 'value'"):
        budget.value = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kind", "value"),
    [("bytes", 0), ("bytes", True), ("bytes", 0.5), ("fraction", 2.0), ("fraction", 1), ("auto", 3), ("gib", 1)],
)
def test_direct_construction_is_validated(kind, value):
    with pytest.raises(ValueError, match=rf"^Budget\(kind='{kind}', value={value!r}\) is not valid: .*Budget.parse"):
        Budget(kind=kind, value=value, text="x")


@pytest.mark.parametrize(
    ("total", "free", "match"),
    [
        (0, 0, "total_bytes must be a positive int of bytes; got 0"),
        (-1, 0, "total_bytes must be a positive int of bytes; got -1"),
        (1.5, 0, "total_bytes must be a positive int of bytes; got 1.5"),
        (GIB, -1, "free_bytes must be a non-negative int of bytes; got -1"),
    ],
)
def test_resolve_rejects_bad_memory_sizes(total, free, match):
    with pytest.raises(ValueError, match=match):
        Budget.parse("1GiB").resolve(total_bytes=total, free_bytes=free)


def test_resolve_is_keyword_only():
    with pytest.raises(TypeError, match="positional argument"):
        Budget.parse("1GiB").resolve(GIB, GIB)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (3 * GIB // 2, "1.50 GiB"),
        (GIB - 1, "1.00 GiB"),  # rounds up into the next unit rather than "1024.00 MiB"
        (80 * GIB, "80.00 GiB"),
        (2**40, "1.00 TiB"),
        (2**50, "1.00 PiB"),
        (-3 * GIB // 2, "-1.50 GiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


# ------------------------------------------------------------------ one resolution: the search's bytes reach the trial
@pytest.mark.parametrize("spec", ["auto", 0.5])
def test_a_trial_is_capped_at_the_bytes_the_search_resolved_not_at_a_reading_of_its_own(
        spec: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search resolves the budget once and hands the trial those bytes: the trial's ElasticBatchSize caps memory at
    exactly what the search judges the trial against, even where a reading in the trial would give other bytes."""
    import torch
    from types import SimpleNamespace

    import autotune._device.probe as probe_module
    from autotune import Plan
    from autotune._search.objective import Objective
    from autotune._search.trial import _trainer
    from autotune.callbacks import ElasticBatchSize

    cpu = torch.device("cpu")
    real = probe_module.probe_memory(cpu)
    total = real.total_bytes
    monkeypatch.setattr(probe_module, "probe_memory",
                        lambda device: dataclasses.replace(real, free_bytes=total // 2))
    resolved = resolve_budget(spec, cpu)  # the search's reading: half of memory free
    runner = object.__new__(Objective)  # the search's objective, as far as a trial's spec goes
    runner.target, runner.config, runner.device, runner.devices, runner.budget = "t.py:make", None, cpu, 1, resolved
    runner.steps, runner.warmup, runner.interval, runner._long_dir = 3, 1, 0.03, None
    runner.estimator = SimpleNamespace(batch_sizes=None, batch=None)
    plan = Plan(micro_batch_size=4)
    spec_ = pickle.loads(pickle.dumps(runner._spec(plan)))  # across the process boundary
    assert (spec_.budget.text, spec_.budget.budget_bytes) == (str(Budget.parse(spec)), runner.budget_bytes)

    monkeypatch.setattr(probe_module, "probe_memory",  # a reading of the trial's own would differ in both
                        lambda device: dataclasses.replace(real, total_bytes=total // 2, free_bytes=total // 4))
    trainer = _trainer(spec_, plan, {}, [], 4, {})
    [elastic] = [c for c in trainer.callbacks if isinstance(c, ElasticBatchSize)]
    assert elastic._resolve_budget(cpu) == (runner.budget_bytes, runner.budget_bytes)
    assert str(elastic.budget) == str(Budget.parse(spec))  # the text, for messages
    # a second resolution, in the trial, would have capped it elsewhere
    assert ElasticBatchSize(budget=spec)._resolve_budget(cpu)[0] != runner.budget_bytes


def test_the_estimate_the_search_and_the_callback_refuse_a_budget_over_the_device_in_one_sentence(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from autotune._cli.main import main
    from autotune._search.search import search
    from autotune.callbacks import ElasticBatchSize

    target = f"{Path(__file__).resolve().parent / 'fixtures' / 'search_target.py'}:make"
    sentence = r"^budget 1000TiB \(1000.00 TiB\) is more than cpu's memory \([0-9.]+ GiB\); give at most that, a share"
    assert main(["estimate", target, "--budget", "1000TiB", "--device", "cpu"]) != 0
    estimate_says = capsys.readouterr().err.strip().removeprefix("autotune: error: ")
    with pytest.raises(ValueError, match=sentence) as searched:
        search(target=target, budget="1000TiB", device="cpu", storage=f"sqlite:///{tmp_path}/s.db", out=None)
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ElasticBatchSize(budget="1000TiB")])
    with pytest.raises(ValueError, match=sentence) as trained:
        trainer.fit(BoringModel())
    assert estimate_says == str(searched.value) == str(trained.value)
    assert not (tmp_path / "s.db").exists()  # refused before the study was opened
