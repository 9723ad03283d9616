"""FSDP2: record each micro-batch's collectives, and issue the rest of them after an out-of-memory error.

Under FSDP2 every forward all-gathers parameters and every backward reduce-scatters gradients. A rank
that runs out of memory half-way stops issuing them while its peers wait inside one, so no vote could reach them.
:class:`CollectiveDrain` wraps the all-gather and reduce-scatter of every FSDP unit (public
``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``; the unit's own communication still does the
work). It logs each call under the micro-batch that runs. A clean micro-batch keeps its log as the schedule of its
kind ``(first, last)``. A schedule depends on the parameters' shapes and the sharding, not on the number of samples,
so it still holds after the micro-batch shrinks.

An OOM may strike at call ``p`` of micro-batch ``j`` (or before the first micro-batch, in ``optimizer.step``). The
failing rank then resets its FSDP state and frees the failed attempt. It issues what its peers still expect on one
zeroed scratch buffer: the rest of ``j``'s schedule, then the whole schedules of the micro-batches after it. Then
every rank joins the step's vote. A schedule also holds the model's own collectives, as "guard" calls (see
:mod:`autotune._runtime.guard`): a draining rank stops at the first, where its peers stand, and its vote meets them.

Some rank may lack the schedule of a kind an attempt needs (the first step; a new split; a schedule that changed).
Then every rank publishes each call in the process group's store before issuing it. A rank that fails follows the
calls its peers publish instead of a schedule. So an OOM in the very first micro-batch of training is drained
without running any user code a second time and without guessing. A follower stops once every other rank has
published that it finished its micro-batches or that it follows too, or publishes a guard.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from autotune._compat.fsdp import clear_fsdp_unsharded_grads, fsdp_comms, fsdp_is_root
from autotune._compat.torch import default_store, process_group_named
from autotune._runtime.agreement import Agreement
from autotune._runtime.state import release_memory

#: Markers a rank publishes in place of a call: it finished its micro-batches, or it follows the others.
_END, _FOLLOW = "end", "follow"

_MISMATCH = (
    "ElasticBatchSize: after an out-of-memory error under FSDP2 this rank had issued collectives that differ from the "
    "micro-batch's recorded schedule (the model's FSDP structure or the set of parameters with gradients changed "
    "since it was recorded), so it cannot issue the rest of them safely; the run stops on every rank.")
_UNSUPPORTED = (
    "Out of memory under FSDP2 (ModelParallelStrategy): ElasticBatchSize cannot replay it, since it could not "
    "record the FSDP units' collectives ({why}); the run stops on every rank. Start with a smaller micro-batch "
    "(ElasticBatchSize(micro_batch_size=...), `autotune estimate` predicts what fits).")


class Call(NamedTuple):
    """One collective of an FSDP unit: what it takes to issue the same call again, without the data."""

    kind: str  # "ag" (all-gather) or "rs" (reduce-scatter)
    out_shape: tuple[int, ...]
    in_shape: tuple[int, ...]
    dtype: torch.dtype
    group: str  # the process group's name
    op: str  # the reduce-scatter's reduction ("" for an all-gather)


def _op_name(op: Any) -> str:
    # Pre-multiplied sums (NCCL) are objects without a name: a drained call sends zeros, so a plain sum is as good.
    return str(getattr(op, "name", "SUM")) if op is not None else ""


# The wrappers follow FSDP2's ``AllGather`` / ``ReduceScatter`` protocols (``allocate`` and the call); their base
# classes live in a private module, so they are not subclassed. They delegate both to the unit's own communication.
class _RecordingAllGather:
    def __init__(self, inner: Any, drain: CollectiveDrain) -> None:
        self.inner, self.drain = inner, drain

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Any:
        self.drain.issuing("ag", output_tensor, input_tensor, group, None)
        try:
            with self.drain.passing():
                return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group,
                                  async_op=async_op)
        except BaseException:
            self.drain.retract()  # not issued: a drain issues it again
            raise


class _RecordingReduceScatter:
    def __init__(self, inner: Any, drain: CollectiveDrain) -> None:
        self.inner, self.drain = inner, drain

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: Any,
                 async_op: bool = False) -> Any:
        self.drain.issuing("rs", output_tensor, input_tensor, group, op)
        try:
            with self.drain.passing():
                return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                                  async_op=async_op)
        except BaseException:
            self.drain.retract()  # not issued: a drain issues it again
            raise


def micro_batch_kinds(count: int) -> list[tuple[bool, bool]]:
    """The kind ``(first, last)`` of each of ``count`` micro-batches."""
    return [(i == 0, i == count - 1) for i in range(count)]


class CollectiveDrain:
    """The FSDP units' collectives per micro-batch kind, and the drain after an OOM; one per fit."""

    def __init__(self, passing: Any = contextlib.nullcontext) -> None:
        self.passing = passing  # a context in which the units' own collectives pass the model's collective guard
        self.schedules: dict[tuple[bool, bool], list[Call]] = {}
        self.units: list[Any] = []
        self.unsupported: str | None = None  # why the units' collectives cannot be recorded, when they cannot
        self.drained = 0  # calls issued by drains so far (for tests)
        self.followed = 0  # of them, calls that followed a peer's published ones
        self._installed = False
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._log: list[Call] | None = None  # the running micro-batch's calls (None outside micro-batches)
        self._kind: tuple[bool, bool] = (True, True)
        self._failed: tuple[int, int] | None = None  # (micro-batch, calls issued) of this rank's OOM
        self._count = 0
        self._changed = False  # a schedule changed in the last attempt: publish in the next one
        self._store: Any = None
        self._publish = False
        self._attempt = 0
        self._seq = 0  # calls (and markers) this rank published in the attempt
        self._issued: list[Call] = []  # the calls a failed micro-batch had issued

    # ------------------------------------------------------------------------------------------------ set up
    def install(self, model: torch.nn.Module) -> None:
        """Wrap the collectives of every FSDP unit of ``model`` (once per fit)."""
        if self._installed:
            return
        from torch.distributed.fsdp import FSDPModule

        self._installed = True
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in self.units:
            comms = fsdp_comms(unit)
            if comms is None:
                continue  # a unit without parameters communicates nothing
            try:
                unit.set_custom_all_gather(_RecordingAllGather(comms[0], self))
                unit.set_custom_reduce_scatter(_RecordingReduceScatter(comms[1], self))
            except ValueError as exc:  # several parameter groups in one unit (per-parameter meshes)
                self.unsupported = str(exc)
                return

    def unsupported_error(self) -> str:
        return _UNSUPPORTED.format(why=self.unsupported)

    # ------------------------------------------------------------------------------------------- per attempt
    def lacks(self, count: int) -> bool:
        """Whether this rank lacks the schedule of a kind that ``count`` micro-batches need, or one changed lately."""
        return self._changed or any(kind not in self.schedules for kind in micro_batch_kinds(count))

    def start_attempt(self, agree: Agreement, count: int) -> int:
        """An attempt begins, this rank wanting ``count`` micro-batches. One collective: the count every rank runs (the
        largest wanted: each FSDP2 micro-batch gathers parameters, so all run alike) and whether some rank lacks a
        schedule the attempt needs (then every call is published, for a failing rank to follow)."""
        wanted = (1, 2, 3)  # the kinds of micro-batches differ for 1, 2 and 3 or more
        most, *lacks = agree.max(float(count), *(float(self.lacks(k)) for k in wanted))
        count = int(most)
        publish = lacks[min(count, 3) - 1] > 0
        self._count = count
        self._failed = None
        self._changed = False
        self._attempt += 1
        self._seq = 0
        self._publish = publish
        if publish:
            self._store = dist.PrefixStore("autotune/drain/", default_store())
        return count

    def begin(self, index: int) -> None:
        """Micro-batch ``index`` begins: log its calls."""
        self._kind = micro_batch_kinds(self._count)[index]
        self._log = []

    def end(self) -> None:
        """The micro-batch ran cleanly: its log is the schedule of its kind."""
        log, self._log = self._log, None
        if log is None:
            return
        known = self.schedules.get(self._kind)
        if known != log:
            self._changed = self._changed or known is not None
            self.schedules[self._kind] = log

    def failed(self, index: int) -> None:
        """The micro-batch ``index`` ran out of memory: stop logging, keep where."""
        self._failed = (index, len(self._log or []))
        self._issued = self._log or []
        self._log = None

    def issuing(self, kind: str, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, op: Any) -> None:
        """Called by the wrappers right before each collective of a unit."""
        if self._log is None:
            return  # outside training micro-batches (validation, a drain): nothing to record
        name = group.group_name
        self._groups.setdefault(name, group)
        call = Call(kind, tuple(out.shape), tuple(inp.shape), out.dtype, name, _op_name(op))
        self._log.append(call)
        if self._publish:
            self._put(self._seq, _encode(call))
            self._seq += 1

    def guard_point(self) -> None:
        """The model is about to make a collective of its own, behind the ranks' guard: logged (and published) as a
        call of kind "guard", where a draining rank stops and votes instead (its peers meet the vote at the guard)."""
        if self._log is None:
            return
        call = Call("guard", (), (), torch.float64, "", "")
        self._log.append(call)
        if self._publish:
            self._put(self._seq, _encode(call))
            self._seq += 1

    def stop(self) -> None:
        """Another rank's failure stopped this rank's micro-batch: its log is dropped (nothing to drain here)."""
        self._log = None

    def retract(self) -> None:
        """The last call raised instead of being issued: forget it (a follower at its place reads the healthy
        ranks' entry instead of this rank's, which it overwrites)."""
        if self._log:
            self._log.pop()
            if self._publish:
                self._seq -= 1

    # -------------------------------------------------------------------------------------------- after an OOM
    def reset(self, optimizer: torch.optim.Optimizer) -> None:
        """Put FSDP back in a state a new forward can start from (all ranks, before a replay): per-iteration state
        of every root reset, unsharded gradients a failed backward left dropped, gradients dropped."""
        for unit in self.units:
            # The roots are the units forwarded first (FSDP decides at the first forward: a LightningModule whose
            # training_step calls a submodule is not one); a unit never forwarded has nothing to reset.
            if fsdp_is_root(unit):
                unit.reset_iter_state()
        for unit in self.units:
            clear_fsdp_unsharded_grads(unit)
        optimizer.zero_grad(set_to_none=True)

    def before_vote(self, failed: bool, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        """Before the attempt's vote: a rank that ``failed`` frees its attempt and issues the collectives its peers
        still expect, up to a guard if one comes first (the peers stand there, and meet the vote); a rank that ran its
        micro-batches says so to ranks following it."""
        if failed:
            if self._failed is None:  # it failed before its first micro-batch (inside ``optimizer.step``, say)
                self._failed, self._issued = (0, 0), []
            self.reset(optimizer)
            release_memory((), device)
            self.drain(device)
        elif self._publish:
            self._put(self._seq, _END)  # this rank ran its micro-batches: ranks following it stop here

    def drain(self, device: torch.device) -> None:
        """Issue the calls the peers still expect from this failed rank: follow their published calls when
        publishing, else the rest of the recorded schedules."""
        if self._failed is None:
            return
        if self._publish:
            self._follow(device)
            return
        index, done = self._failed
        kinds = micro_batch_kinds(self._count)
        current = self.schedules[kinds[index]]
        if current[:done] != self._issued:
            raise RuntimeError(_MISMATCH)
        rest = current[done:] + [c for kind in kinds[index + 1:] for c in self.schedules[kind]]
        guard = next((i for i, c in enumerate(rest) if c.kind == "guard"), len(rest))
        self._issue(rest[:guard], device)  # a guard: the peers stand there, where this rank's vote meets them

    def end_attempt(self) -> None:
        """After the vote (no rank reads this attempt's published calls any more): delete what this rank wrote."""
        if self._publish and self._store is not None:
            for seq in range(self._seq + 1):
                self._store.delete_key(self._key(dist.get_rank(), seq))
        # Hold no store or group past the attempt: a reference alive at interpreter exit, after the process group
        # was destroyed, can abort the shutdown of gloo's threads.
        self._store, self._groups = None, {}
        self._publish = False
        self._issued = []

    def _follow(self, device: torch.device) -> None:
        me, world = dist.get_rank(), dist.get_world_size()
        while True:
            self._put(self._seq, _FOLLOW)
            seen = [self._store.get(self._key(r, self._seq)).decode() for r in range(world) if r != me]
            calls = [s for s in seen if s not in (_END, _FOLLOW)]
            if not calls:
                return  # every other rank finished or follows too: nobody waits in a collective
            call = _decode(calls[0])
            if call.kind == "guard":
                return  # the others stand at a guard: the vote meets them there
            self._seq += 1
            self.followed += 1
            self._issue([call], device)

    def _issue(self, calls: list[Call], device: torch.device) -> None:
        """Issue ``calls`` with zeros from one scratch buffer per dtype (as large as the largest call)."""
        if not calls:
            return
        scratch: dict[torch.dtype, torch.Tensor] = {}
        for dtype in {c.dtype for c in calls}:
            size = max(_numel(c.out_shape) + (_numel(c.in_shape) if c.kind == "rs" else 0)
                       for c in calls if c.dtype == dtype)
            scratch[dtype] = torch.empty(size, dtype=dtype, device=device)
        for call in calls:
            group = self._group(call.group)
            buf = scratch[call.dtype]
            n_out = _numel(call.out_shape)
            out = buf[:n_out].view(call.out_shape)
            if call.kind == "ag":
                inp = out.view(group.size(), -1)[group.rank()].view(call.in_shape)  # this rank's slot, as FSDP's
                inp.zero_()
                dist.all_gather_single(out, inp, group=group)
            else:
                inp = buf[n_out:n_out + _numel(call.in_shape)].view(call.in_shape)
                inp.zero_()
                dist.reduce_scatter_single(out, inp, op=getattr(dist.ReduceOp, call.op), group=group)
            self.drained += 1

    def _group(self, name: str) -> dist.ProcessGroup:
        group = self._groups.get(name)
        if group is None:
            group = self._groups[name] = process_group_named(name)
        return group

    def _key(self, rank: int, seq: int) -> str:
        return f"{self._attempt}/{rank}/{seq}"

    def _put(self, seq: int, value: str) -> None:
        self._store.set(self._key(dist.get_rank(), seq), value)


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _encode(call: Call) -> str:
    return json.dumps([call.kind, call.out_shape, call.in_shape, str(call.dtype).removeprefix("torch."), call.group,
                       call.op])


def _decode(text: str) -> Call:
    kind, out_shape, in_shape, dtype, group, op = json.loads(text)
    return Call(kind, tuple(out_shape), tuple(in_shape), getattr(torch, dtype), group, op)
