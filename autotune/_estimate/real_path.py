"""Trace a step with real tensors on the host, for a step the trace without data cannot follow, or when asked.

This is the estimator's real-tensor path (see :meth:`autotune._estimate.trace.Traces`). It serves a step that reads
tensor values or has an op without a fake rule. It decides which micro-batches to trace, draws the line through two
of them, and handles activation offload with data.

Which micro-batches are traced is decided by the work itself, never by the clock, so the same model, batch and plan
get the same answer on an idle host and a busy one. Micro-batches 1 and 2 are traced first. From them, the work of
the asked micro-batch ``m`` is on their line: its FLOPs (of the ops torch's flop counter knows), the bytes it allocates
(every storage the step makes: the traffic of the elementwise ops FLOPs do not count) and the host memory it holds.
Within ``REAL_FLOPS``, ``REAL_ALLOCATED_BYTES`` and ``REAL_HOST_SHARE`` of the host's memory, ``m`` is traced
directly. Else the largest power of two ``b`` within them (4 at least), ``b / 2`` and ``3 b / 4`` are traced.

The three steps may run the same ops, with each moment of ``3 b / 4`` (the bytes alive after an op) on the line of
the same moment of the other two. Then each moment is taken along its own line to ``m`` and the peak is the highest
of them. That way a change of regime past ``b`` (a backward whose peak moves from the update to a recomputed block)
is seen, which the line through the two peaks misses (docs/plan.md gives the figures). Where they do not
(data-dependent routing: which experts run, and with how many tokens, follows the data), the part of each peak above
the model state grows in proportion to the micro-batch. No step whose tensors are a fixed part plus a part per sample
exceeds that. Either way the answer is at least the
line through the two peaks and the peak at ``b``: never lower than what the host traced.

A traced micro-batch here is a :class:`~autotune._estimate.result.Traced` (its ``phases``, each with ``estimate``,
``update_temporaries``, ``backward``, ``timeline`` and ``ops``; its ``flops`` and ``allocated_bytes``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

from autotune._device.budget import format_bytes

__all__ = ["MOMENT_TOLERANCE", "REAL_ALLOCATED_BYTES", "REAL_DIRECT", "REAL_FLOPS", "REAL_HOST_SHARE", "REAL_NOTE",
           "choose", "extrapolated", "from_bytes", "peak_of", "to_bytes"]

#: Micro-batches up to this one are always traced directly.
REAL_DIRECT = 4
#: The most work one traced micro-batch may take on the host: FLOPs, bytes allocated (each storage once, as it is
#: made), and share of the host's total memory held. About 10 s of a slow host's two cores at full load.
REAL_FLOPS = 100e9
REAL_ALLOCATED_BYTES = 64 * 2**30
REAL_HOST_SHARE = 0.5
#: What every first note of this path says after its reason (``Estimate.notes[0]``).
REAL_NOTE = "traced with real tensors on the host at micro"

T = TypeVar("T")
#: The parts of a phase's peak that do not grow with the micro-batch.
_STATE = ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "overhead_bytes")


def peak_of(traced: Any) -> int:
    """The higher of a traced micro-batch's phase peaks."""
    return max(p.estimate.predicted_peak_bytes for p in traced.phases)


def _host_of(traced: Any) -> int:
    return max(p.estimate.host_bytes for p in traced.phases)


def choose(*, micro: int, one: Any, two: Any, host_total_bytes: int) -> tuple[int | None, str]:
    """Decide how to answer for ``micro`` (over :data:`REAL_DIRECT`) from micro-batches 1 and 2 traced as it runs.

    Returns ``(None, "")`` to trace it directly. Else it returns ``(b, why)``: extrapolate from ``b / 2`` and ``b``,
    the largest power of two below ``micro`` whose work is within the limits (4 at least). ``why`` is the clause that
    says which limit ``micro`` passes.

    Example:
        >>> choose(micro=16, one=traced_1, two=traced_2, host_total_bytes=64 * 2**30)  # doctest: +SKIP
        (None, '')
    """

    def on_line(m: int, at_one: int, at_two: int) -> int:
        return at_one + (at_two - at_one) * (m - 1)

    def over(m: int) -> str | None:
        flops = on_line(m, one.flops, two.flops)
        if flops > REAL_FLOPS:
            return f"{flops / 1e9:.0f} GFLOP per step, over the {REAL_FLOPS / 1e9:.0f} the real-tensor path traces"
        allocated = on_line(m, one.allocated_bytes, two.allocated_bytes)
        if allocated > REAL_ALLOCATED_BYTES:
            return (f"{format_bytes(allocated)} of allocations per step, over the "
                    f"{format_bytes(REAL_ALLOCATED_BYTES)} the real-tensor path traces")
        need = on_line(m, peak_of(one) + _host_of(one), peak_of(two) + _host_of(two))
        if need > REAL_HOST_SHARE * host_total_bytes:
            return (f"{format_bytes(need)} of the host's memory, over {REAL_HOST_SHARE:.0%} of its "
                    f"{format_bytes(host_total_bytes)}")
        return None

    why = over(micro)
    if why is None:
        return None, ""
    b = REAL_DIRECT
    while 2 * b < micro and over(2 * b) is None:
        b *= 2
    return b, f"micro {micro} would take {why}"


#: How far (a share of its peak) a moment of the third traced micro-batch may lie off the line of the other two's
#: for each moment's line to be trusted (CUDA's 512-byte rounding moves moments by a few KiB).
MOMENT_TOLERANCE = 0.005


def _on_lines(pa: Any, pb: Any, pc: Any, a: int, b: int, c: int) -> bool:
    """Whether a phase's moments lie on lines: the three steps ran the same ops, and each moment of ``c`` lies on the
    line of ``a`` and ``b`` (not where sizes follow the data, as routed tokens' do)."""
    if not pa.timeline or not pa.ops == pb.ops == pc.ops:
        return False
    share, tolerance = (c - a) / (b - a), MOMENT_TOLERANCE * max(pc.timeline)
    return all(abs(ya + (yb - ya) * share - yc) <= tolerance for ya, yb, yc in zip(pa.timeline, pb.timeline,
                                                                                      pc.timeline))


def _at(pa: Any, pb: Any, a: int, b: int, micro: int) -> int:
    """A phase's peak at ``micro`` from its moments at ``a`` and ``b``, each on its own line (the overhead beside
    them)."""
    share = (micro - a) / (b - a)
    return round(max(ya + (yb - ya) * share for ya, yb in zip(pa.timeline, pb.timeline))) + pb.estimate.overhead_bytes


def _proportional(pb: Any, b: int, micro: int, accumulate: bool) -> int:
    """A phase's peak at ``micro`` >= ``b`` at most: its bytes above the model state alive all through the phase
    (weights, optimizer state, overhead; the gradients in the forward and when accumulating) grown in proportion to
    the micro-batch. Every tensor's size is a sum of a fixed part and a per-sample part, so no moment grows faster."""
    e = pb.estimate
    fixed = (e.parameters_bytes + e.optimizer_state_bytes + e.overhead_bytes
             + (e.gradients_bytes if accumulate or not pb.backward else 0))
    return fixed + round((e.predicted_peak_bytes - fixed) * micro / b)


def extrapolated(at_a: T, at_b: T, a: int, b: int, micro: int, *, check: tuple[int, Any], accumulate: bool,
                 why: str) -> T:
    """Extrapolate the estimate at ``micro`` from traces at micro-batches ``a`` < ``b`` (see the module notes).

    Each phase's peak comes from its moments where a third traced micro-batch (``check``) confirms they lie on lines,
    else in proportion above the model state. It is at least on the line through the two peaks and at ``b``. The model
    state and overhead are as at ``b``, the temporaries on their line, the activations taking up the rest. The first
    note says so, why (``why``), and how far
    the third lies off."""

    def line(x: int, y: int, at: int) -> int:
        return max(0, round(y + (y - x) * (at - b) / (b - a)))

    m, traced = check
    triples = list(zip(at_a.phases, at_b.phases, traced.phases))  # type: ignore[attr-defined]
    moments = all(_on_lines(pa, pb, pc, a, b, m) for pa, pb, pc in triples)
    at_check = max(_at(pa, pb, a, b, m) if moments else line(pa.estimate.predicted_peak_bytes,
                                                              pb.estimate.predicted_peak_bytes, m)
                   for pa, pb, _ in triples)
    off = abs(at_check - peak_of(traced)) / peak_of(traced)
    how = ("along each moment's line" if moments else
           f"in proportion above the model state (micro {m}'s moments do not lie on their lines: the ops or sizes "
           "follow the data)")
    head = at_b.phases[0].estimate.notes[0].split(f": {REAL_NOTE}")[0]  # type: ignore[attr-defined]
    note = (f"{head}: {REAL_NOTE} {a} and {b} and extrapolated to {micro} {how} ({why}; micro {m} lies {off:.1%} off "
            f"{'them' if moments else 'the line through the peaks'})")
    phases = []
    for pa, pb, _ in triples:
        ea, eb = pa.estimate, pb.estimate
        peak = max(_at(pa, pb, a, b, micro) if moments else _proportional(pb, b, micro, accumulate),
                   line(ea.predicted_peak_bytes, eb.predicted_peak_bytes, micro), eb.predicted_peak_bytes)
        # model state and overhead as at b (they do not grow with the samples: at small micro-batches routing may
        # leave experts without gradients, which a larger one gives them), temporaries on their line
        parts = {name: getattr(eb, name) for name in _STATE}
        rest = max(0, peak - sum(parts.values()))
        parts["temporaries_bytes"] = min(rest, line(ea.temporaries_bytes, eb.temporaries_bytes, micro))
        parts["activations_bytes"] = rest - parts["temporaries_bytes"]
        estimate = dataclasses.replace(eb, **parts, predicted_peak_bytes=sum(parts.values()),
                                       host_bytes=max(eb.host_bytes, line(ea.host_bytes, eb.host_bytes, micro)),
                                       micro_batch_size=micro, plan=eb.plan.replace(micro_batch_size=micro),
                                       method="extrapolated", notes=(note, *eb.notes[1:]))
        phases.append(dataclasses.replace(pb, estimate=estimate, timeline=(), ops=(),
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
