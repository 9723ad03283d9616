"""The target's own code failing, told apart from our bugs and from the estimator's limits, and said in a few lines.

A search, an estimate and a suggestion run the user's code: its factory, dataloader, ``configure_optimizers`` and
``training_step``. When that code fails (a dataloader that raises, a ``training_step`` that reads an attribute it does
not have, a module Lightning refuses), no plan can help and the run must stop at once with what the user needs to fix
it: the exception, the user's own frames (file, line, code; none of ours, Lightning's, torch's or Optuna's) and what
was being done (loading a batch, the first training step). :func:`target_failure` makes that judgement:

- Lightning's configuration errors (``MisconfigurationException`` raised by Lightning, not by our callbacks' checks
  of a plan) and our :class:`TargetError` (a target we refused: a dataloader that yields no batch) are the target's.
- Otherwise the exception is the target's when the innermost frame that is neither ours nor a library's (the standard
  library, site-packages, torch's generated code) is the user's: their code raised it, or called torch or Lightning
  with something those refused (a shape mismatch in ``cross_entropy``). In the estimator's trace (no Trainer, maybe
  no data) what Lightning or torch's fake tensors raise is the trace's limit, not the user's mistake.
- An exception whose innermost such frame is ours is our bug (or our deliberate refusal of a plan): it is left as
  it is, with its traceback.

A DataLoader worker's error and a DDP rank's reach the parent as text ("Original Traceback ..."): their frames are
read from it. An out-of-memory error anywhere in the chain is never the target's failure: it is a plan that does not
fit, an infeasible trial.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from autotune._compat.torch import FAKE_TENSOR_CODE
from autotune._target.config import TargetError

__all__ = ["TargetCodeError", "failure_lines", "target_code", "target_failure"]

#: How many of the user's innermost frames are shown.
SHOWN_FRAMES = 3


class TargetCodeError(TargetError):
    """The target's own code failed (or Lightning refused it); ``lines``: the exception and what was being done, then
    the user's frames, one line each (the CLI prints them as they are)."""

    def __init__(self, lines: Sequence[str]) -> None:
        self.lines = [str(line) for line in lines] or ["the target's code failed"]
        super().__init__("\n".join(self.lines))

    def add(self, line: str) -> None:
        """One more line (what the search kept, how to resume)."""
        self.lines.append(line)
        self.args = ("\n".join(self.lines),)


@dataclass(frozen=True)
class Frame:
    """One frame of a traceback: file, line number, function and the line's code."""

    file: str
    line: int
    function: str
    code: str


def target_failure(error: BaseException, *, spec: str, traced: bool = False) -> TargetCodeError | None:
    """``error`` as the target's failure (see the module docstring), or None when it is not the target's.

    Args:
        error: the exception raised while running the target's code (its causes are followed).
        spec: the TARGET as given, named in the first line.
        traced: the code ran in the estimator's trace of the first training step (without a Trainer, maybe without
            data): what Lightning or torch's fake tensors raise there is the trace's limit, not the target's failure.

    Example:
        >>> target_failure(KeyError("tokens"), spec="t.py:make") is None  # no traceback: nothing to tell
        True
    """
    lines = failure_lines(error, spec=spec, traced=traced)
    return None if lines is None else TargetCodeError(lines)


def failure_lines(error: BaseException, *, spec: str, traced: bool = False) -> list[str] | None:
    """The lines of :class:`TargetCodeError` for ``error``, or None when it is not the target's failure (plain data:
    a trial process sends them to the search). Never raises: telling a failure apart must not lose it."""
    if isinstance(error, KeyboardInterrupt):
        return None
    try:
        return _lines(error, spec=spec, traced=traced)
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def _lines(error: BaseException, *, spec: str, traced: bool) -> list[str] | None:
    from autotune._device.oom import OutOfMemoryAtMinimumError, is_oom_error

    chain = _chain(error)
    if any(is_oom_error(e) or isinstance(e, OutOfMemoryAtMinimumError) for e in chain):
        return None  # a plan that does not fit: infeasible, not a failure
    refused = next((e for e in chain if isinstance(e, TargetError)), None)
    if isinstance(refused, TargetCodeError):
        return refused.lines
    root = chain[-1]
    frames = _frames(root)
    configuration = any(_is_misconfiguration(e) and not _raised_by_us(e) for e in chain)
    if not (configuration or refused is not None or _raised_by_user(frames, traced=traced)):
        return None
    user = [f for f in frames if _kind(f.file) == "user"]
    if refused is not None:  # our sentence about the target (it names the target), and where its cause arose
        lines = [_one_line(refused)]
    else:
        doing = _doing(frames, _global_step(root), traced)
        doing = "Lightning refused it:" if configuration and doing == _RUNNING else f"{doing} raised"
        lines = [f"target '{spec}': {doing} {_exception_line(root)}"]
    lines += [f"  {_shown(f.file)}:{f.line}, in {f.function}" + (f": {f.code}" if f.code else "")
              for f in user[-SHOWN_FRAMES:]]
    return lines


@contextlib.contextmanager
def target_code(spec: str, *, traced: bool = False) -> Iterator[None]:
    """Run the target's code: a failure that is the target's (:func:`target_failure`) is raised as
    :class:`TargetCodeError`, anything else as it was."""
    try:
        yield
    except TargetCodeError:
        raise
    except Exception as error:
        failure = target_failure(error, spec=spec, traced=traced)
        if failure is None:
            raise
        raise failure from error


# ---------------------------------------------------------------------------------------------------- judging


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes (explicit, else implicit), outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return chain


def _is_misconfiguration(error: BaseException) -> bool:
    """Lightning's configuration error (checked by name: Lightning need not be imported where this runs)."""
    return any(cls.__name__ == "MisconfigurationException" and cls.__module__.startswith("lightning")
               for cls in type(error).__mro__)


def _raised_by_us(error: BaseException) -> bool:
    """Whether our code raised ``error`` itself (a refusal of a plan: its trials fail, the search goes on)."""
    frames = _frames(error)
    return bool(frames) and _kind(frames[-1].file) == "ours"


def _raised_by_user(frames: Sequence[Frame], *, traced: bool) -> bool:
    """Whether the user's code raised it: the innermost frame that is neither ours nor a library's is the user's (in
    the estimator's trace: and Lightning, which has no Trainer there, or the fake tensors did not raise it)."""
    kinds = [_kind(f.file) for f in frames if _kind(f.file) != "library"]
    if not kinds or kinds[-1] != "user":
        return False
    innermost = frames[-1].file
    return not (traced and _kind(innermost) == "library" and any(part in innermost for part in _TRACE_LIMITS))


#: Where an error raised in the estimator's trace is the trace's limit: Lightning (the module has no Trainer there),
#: torch's fake tensors (a value read, an op without a fake rule).
_TRACE_LIMITS = tuple(f"{os.sep}{name}{os.sep}" for name in ("lightning", "pytorch_lightning", "lightning_fabric")) + (
    FAKE_TENSOR_CODE.replace("/", os.sep),)


def _frames(error: BaseException) -> list[Frame]:
    """The frames of ``error``, outermost first: read from its text where it carries another process's traceback
    (a DataLoader worker's, a DDP rank's), else from its own traceback."""
    text = str(error)
    if "Traceback (most recent call last)" in text:
        found = [Frame(m["file"], int(m["line"]), m["function"], (m["code"] or "").strip())
                 for m in _TEXT_FRAME.finditer(text)]
        if found:
            return found
    frames = []
    tb: TracebackType | None = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append(Frame(code.co_filename, tb.tb_lineno, code.co_name, _source_line(code.co_filename, tb.tb_lineno)))
        tb = tb.tb_next
    return frames


_TEXT_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n(?:(?P<code>[^\n]*)\n)?',
                         re.MULTILINE)


def _source_line(file: str, line: int) -> str:
    import linecache

    return linecache.getline(file, line).strip()


def _kind(file: str) -> str:
    """``"ours"`` (autotune, its callbacks and spaces), ``"library"`` (the standard library, installed packages,
    generated code) or ``"user"``."""
    if file.startswith("<"):
        return "library"
    path = os.path.realpath(file)
    if any(path.startswith(root) for root in _roots()[0]):
        return "ours"
    parts = Path(path).parts
    if "site-packages" in parts or "dist-packages" in parts or "torchinductor" in path \
            or any(path.startswith(root) for root in _roots()[1]):
        return "library"
    return "user"


_ROOTS: tuple[tuple[str, ...], tuple[str, ...]] | None = None


def _roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Our packages' folders, and the standard library's."""
    global _ROOTS
    if _ROOTS is None:
        ours = []
        for name in ("autotune", "autotune.callbacks", "autotune.search_spaces"):
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin:
                ours.append(os.path.realpath(os.path.dirname(spec.origin)) + os.sep)
        paths = sysconfig.get_paths()
        stdlib = {os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if paths.get(k)}
        _ROOTS = (tuple(ours), tuple(stdlib))
    return _ROOTS


# ---------------------------------------------------------------------------------------------------- telling


#: What a frame's function says was being done, looked up from the innermost frame out.
_DOING = (
    (("training_step",), "step"),
    (("validation_step",), "a validation step"),
    (("configure_optimizers", "_init_optimizers_and_lr_schedulers"), "configuring the optimizers"),
    (("configure_model",), "configuring the model"),
    (("__getitem__", "__getitems__", "__iter__", "__next__", "train_dataloader", "collate_fn", "default_collate",
      "fetch"), "loading a batch"),
    (("backward", "run_backward"), "the backward pass"),
    (("setup", "prepare_data"), "setting up"),
)


def _doing(frames: Sequence[Frame], step: int | None, traced: bool) -> str:
    for frame in reversed(frames):
        for names, what in _DOING:
            if frame.function in names:
                if what != "step":
                    return what
                if step is not None:
                    return "the first training step" if step == 0 else f"training step {step + 1}"
                return "the first training step" if traced else "a training step"
        if frame.function.startswith("on_") and _kind(frame.file) == "user":
            return f"the {frame.function} hook"
    return _RUNNING


_RUNNING = "running its code"


def _global_step(error: BaseException) -> int | None:
    """The trainer's ``global_step`` when it failed, from the frames' own objects (a Lightning loop's trainer)."""
    tb = error.__traceback__
    step = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        with contextlib.suppress(Exception):
            trainer = owner if type(owner).__name__ == "Trainer" else getattr(owner, "trainer", None)
            value = getattr(trainer, "global_step", None)
            if isinstance(value, int) and not isinstance(value, bool):
                step = value
        tb = tb.tb_next
    return step


def _exception_line(error: BaseException) -> str:
    """``KeyError: "sample 3 has no 'tokens'"``: the type and message (a worker's text: its last line) in one line."""
    text = str(error)
    if "Traceback (most recent call last)" in text:
        last = [line.strip() for line in text.splitlines() if line.strip()]
        return last[-1][:300] if last else type(error).__name__
    message = " ".join(text.split())
    return f"{type(error).__name__}: {message}"[:300] if message else type(error).__name__


def _shown(file: str) -> str:
    """A path relative to the current folder where it is under it."""
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(file)
        if not relative.startswith(".."):
            return relative
    return file


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())

