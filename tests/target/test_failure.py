"""Telling the target's own failure apart (autotune/_target/failure.py): the user's code raised it, or Lightning
refused it; not our bug, not an out-of-memory error, not the estimator's trace reaching its limits."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from autotune._target.failure import TargetCodeError, failure_lines, target_code

USER_CODE = '''\
import torch
from torch.utils.data import DataLoader, Dataset

from autotune import Plan


def raises():
    raise KeyError("tokens")


def bad_shapes():
    return torch.nn.functional.cross_entropy(torch.randn(3, 4), torch.zeros(5, dtype=torch.long))


def calls_ours():
    return Plan(precision="fp7")  # our check refuses it: not the user's failure to report, ours


def oom():
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class Broken(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {}["x"]


def from_a_worker():
    return next(iter(DataLoader(Broken(), batch_size=2, num_workers=1)))


def asks_lightning(module):
    return module.trainer.precision
'''


@pytest.fixture()
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "user_code.py").write_text(USER_CODE)
    spec = importlib.util.spec_from_file_location("user_code_for_failures", tmp_path / "user_code.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lines(fn, *args, traced: bool = False) -> list[str] | None:
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001 - what the judgement is given
        return failure_lines(error, spec="t.py:make", traced=traced)
    raise AssertionError("it did not raise")


def _line(text: str) -> int:
    return next(i for i, line in enumerate(USER_CODE.splitlines(), 1) if text in line)


def test_the_users_raise_is_the_targets_failure_with_its_frame(user: ModuleType) -> None:
    lines = _lines(user.raises)  # (the frames before it are this test's: the user's too)
    assert lines[0] == "target 't.py:make': running its code raised KeyError: 'tokens'"
    assert lines[-1] == f"  user_code.py:{_line('KeyError(')}, in raises: raise KeyError(\"tokens\")"


def test_torch_refusing_what_the_users_code_asked_is_the_targets(user: ModuleType) -> None:
    lines = _lines(user.bad_shapes)
    assert lines[0].startswith("target 't.py:make': running its code raised ValueError: Expected input batch_size (3)")
    assert lines[-1] == (f"  user_code.py:{_line('cross_entropy')}, in bad_shapes: return torch.nn.functional."
                         "cross_entropy(torch.randn(3, 4), torch.zeros(5, dtype=torch.long))")  # no torch frame


def test_our_own_refusal_or_bug_is_not_the_targets(user: ModuleType) -> None:
    assert _lines(user.calls_ours) is None  # raised in autotune's code: its traceback stays
    with pytest.raises(ValueError, match="invalid plan"), target_code("t.py:make"):
        user.calls_ours()


def test_an_out_of_memory_error_is_never_the_targets_failure(user: ModuleType) -> None:
    assert _lines(user.oom) is None
    try:
        user.oom()
    except torch.OutOfMemoryError as error:
        wrapped = ValueError("cannot trace the step")
        wrapped.__cause__ = error
        assert failure_lines(wrapped, spec="t.py:make") is None  # anywhere in the chain


def test_a_dataloader_workers_error_is_read_from_its_text(user: ModuleType) -> None:
    lines = _lines(user.from_a_worker)
    assert lines == ["target 't.py:make': loading a batch raised KeyError: 'x'",
                     f"  user_code.py:{_line('{}[')}, in __getitem__: return {{}}[\"x\"]"]


def test_lightning_without_a_trainer_in_the_estimators_trace_is_its_limit(user: ModuleType) -> None:
    import lightning as L

    module = L.LightningModule()
    assert _lines(user.asks_lightning, module, traced=True) is None  # the trace has no Trainer to give
    lines = _lines(user.asks_lightning, module)  # a real run: the module really is not attached
    assert lines[0] == ("target 't.py:make': running its code raised RuntimeError: LightningModule is not attached to "
                        "a `Trainer`.")


def test_lightnings_configuration_error_is_the_targets_but_our_checks_of_a_plan_are_not() -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from autotune.callbacks._checks import check_trainer

    try:
        raise MisconfigurationException("No `configure_optimizers()` method defined.")
    except MisconfigurationException as error:
        assert failure_lines(error, spec="t.py:make")[0] == (
            "target 't.py:make': Lightning refused it: MisconfigurationException: No `configure_optimizers()` method "
            "defined.")
    trainer = type("T", (), {"accumulate_grad_batches": 4, "callbacks": []})()
    try:
        check_trainer(trainer, None)  # type: ignore[arg-type]
    except MisconfigurationException as error:
        assert failure_lines(error, spec="t.py:make") is None  # raised by our check: a plan's trial failure


def test_ctrl_c_and_a_failure_without_a_traceback_are_not_judged() -> None:
    assert failure_lines(KeyboardInterrupt(), spec="t.py:make") is None
    assert failure_lines(KeyError("x"), spec="t.py:make") is None
    with pytest.raises(TargetCodeError) as info:
        with target_code("t.py:make"):
            raise TargetCodeError(["target 't.py:make': it broke", "  here"])
    assert info.value.lines == ["target 't.py:make': it broke", "  here"]
