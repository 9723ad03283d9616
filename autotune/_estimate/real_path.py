"""The estimator's real-tensor path, for steps that read tensor values (see :meth:`autotune._estimate.trace.Traces`):
how much of the host it may take, the line through two traced micro-batches, and activation offload with data.

A traced micro-batch here is a :class:`~autotune._estimate.result.Traced` (its ``phases``, each with ``estimate``,
``update_temporaries`` and ``backward``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

__all__ = ["REAL_HOST_SHARE", "REAL_NOTE", "REAL_SECONDS", "extrapolated", "from_bytes", "peak_of", "to_bytes"]

#: Host seconds and share of the host's free memory that the real-tensor path may spend on one traced micro-batch;
#: a larger one lies on the line through two it can trace (a step's peak grows by about the same bytes per sample).
REAL_SECONDS = 5.0
REAL_HOST_SHARE = 0.5
#: How every note of this path begins (``Estimate.notes[0]``).
REAL_NOTE = "the step reads tensor values: traced with real tensors on the host at micro"

T = TypeVar("T")
#: The parts of a phase's peak that do not grow with the micro-batch.
_STATE = ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "overhead_bytes")


def peak_of(traced: Any) -> int:
    """The higher of a traced micro-batch's phase peaks."""
    return max(p.estimate.predicted_peak_bytes for p in traced.phases)


def extrapolated(at_a: T, at_b: T, a: int, b: int, micro: int, *, check: tuple[int, Any]) -> T:
    """``micro`` on the line through traces at micro-batches ``a`` < ``b``: each phase's peak on its line; its model
    state and overhead as at ``b``, its temporaries on their line, and the activations taking up the rest (the moment
    of the peak can move between ``a`` and ``b``, so the parts' lines need not add up to the peak's); a note says how
    far another traced micro-batch (``check``) lies off the line."""

    def line(x: int, y: int, at: int) -> int:
        return max(0, round(y + (y - x) * (at - b) / (b - a)))

    m, traced = check
    on_line = max(line(pa.estimate.predicted_peak_bytes, pb.estimate.predicted_peak_bytes, m)
                  for pa, pb in zip(at_a.phases, at_b.phases))  # type: ignore[attr-defined]
    off = abs(on_line - peak_of(traced)) / peak_of(traced)
    note = (f"{REAL_NOTE} {a} and {b} and extrapolated along their line to {micro} (micro {m} lies {off:.1%} off "
            "that line)")
    phases = []
    for pa, pb in zip(at_a.phases, at_b.phases):  # type: ignore[attr-defined]
        ea, eb = pa.estimate, pb.estimate
        # model state and overhead as at b (they do not grow with the samples: at small micro-batches routing may
        # leave experts without gradients, which a larger one gives them), temporaries on their line
        parts = {name: getattr(eb, name) if name in _STATE else line(getattr(ea, name), getattr(eb, name), micro)
                 for name in (f"{c}_bytes" for c in eb.breakdown()) if name != "activations_bytes"}
        peak = line(ea.predicted_peak_bytes, eb.predicted_peak_bytes, micro)
        parts["activations_bytes"] = max(0, peak - sum(parts.values()))
        notes = (note, *(n for n in eb.notes if not n.startswith(REAL_NOTE)))
        estimate = dataclasses.replace(eb, **parts, predicted_peak_bytes=sum(parts.values()),
                                       host_bytes=line(ea.host_bytes, eb.host_bytes, micro), micro_batch_size=micro,
                                       plan=eb.plan.replace(micro_batch_size=micro), method="extrapolated",
                                       notes=notes)
        phases.append(dataclasses.replace(pb, estimate=estimate,
                                          update_temporaries=line(pa.update_temporaries, pb.update_temporaries, micro)))
    return dataclasses.replace(at_b, phases=tuple(phases))  # type: ignore[type-var]


def to_bytes(t: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    """A saved tensor off the device (activation offload, what-if): a meta tensor, which the tracker counts as the
    host's, and its data in bytes, which it does not see."""
    if t.numel() == 0:  # an expert no token was routed to
        return t.to("meta"), b""
    return t.to("meta"), t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def from_bytes(packed: tuple[torch.Tensor, bytes]) -> torch.Tensor:
    """The saved tensor back from :func:`to_bytes`."""
    meta, data = packed
    if not data:
        return torch.empty(meta.shape, dtype=meta.dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(meta.dtype).view(meta.shape)
