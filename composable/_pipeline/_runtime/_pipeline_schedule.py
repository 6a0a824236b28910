"""``PipelineSchedule``: run one training step of a split model over microbatches.

[Note: one pipeline step]
``step(inputs, targets)`` cuts the batch into ``m`` equal microbatches along dim 0 and runs this
rank's action list (`build_schedule`). ``F(s, i)``: take microbatch ``i``'s activation from stage
``s - 1`` (stage 0: none), run stage ``s``'s shell and send its last block's output on; the last
stage computes ``loss_fn(output, targets_i)``. ``B(s, i)``: backpropagate ``loss_i / m`` (last
stage) or the received output gradient, then send the input gradient back. ``I`` sends the input
gradient at once and keeps the graph for ``W`` ([Note: split backward] in
``_pipeline/_split/_split_backward.py``). ``FB`` runs a forward and a backward of two other
(stage, microbatch)s ([Note: forward/backward pairs], below). With mean-reduced losses over
equal microbatches the gradients are those of the whole batch on one process. ``fully_shard``
units: [Note: fully_shard units in a pipeline step] in ``_units.py``.

End of step: one small all-reduce on the ``pp`` group carries a failure flag and the losses. A
rank whose action raised first sends the error to its neighbours ([Note: messages between
stages]), then joins that all-reduce, so every rank raises the same ``PipelineError``.

[Note: forward/backward pairs]
A pair ([Note: action kinds] in ``_pipeline/_schedules/_actions.py``) lists a forward and a
backward on one rank as one action so they can overlap. Its halves must never wait on each other,
even through other ranks: `PipelineSchedule` checks with `simulate(..., overlap=1.0)` when built
and refuses the schedule otherwise, so either half may go first. Without an overlap function the
half whose input is there first runs first: a local input or none, else the one the common peer
sends first, else (two peers, gloo's receives posted ahead: [Note: receiving ahead] in
``_p2p.py``) whichever arrives first ([Note: waiting for the first arrival] in ``_arrival.py``);
the forward on a tie and on NCCL. The halves touch different stages, so the order changes no
number. Each half's output is sent when it ends ([Note: sends held back] in ``_p2p.py``).
With ``overlap=fn`` (torch's ``register_custom_function(OVERLAP_F_B, fn)``), ``fn(pair)`` gets a
`PairHalves` once both inputs are taken and must call ``pair.forward()`` and ``pair.backward()``
once each, from this thread, in either order; otherwise the step fails on every rank naming the
pair (docs/pipeline.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._schedules import Action, ActionKind, ScheduleSpec, get_schedule, simulate, stage_rank
from .._split import PipelineSplit, SplitCache, StageShell, input_grad, weight_grad
from ._boundary import check_boundary
from ._p2p import P2P, PeerFailed
from ._step_state import (PipelineError, StepState, agree_on_tag, capture_hook, device_of, first_tensor, inject_hook,
                          split_batch)
from ._units import StageUnits

__all__ = ["OverlapFn", "PHASE", "PairHalves", "PipelineSchedule", "RUNNABLE_KINDS"]

RUNNABLE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.FB})
"""The action kinds this runtime executes; a schedule with others is refused when it is built."""

PHASE = {ActionKind.F: "forward", ActionKind.B: "backward", ActionKind.I: "input-gradient backward",
         ActionKind.W: "weight-gradient backward", ActionKind.FB: "forward/backward pair"}
"""What an action kind is called in error messages."""


@dataclass
class PairHalves:
    """What an overlap function gets for one pair: see [Note: forward/backward pairs]."""

    action: Action
    forward: Callable[[], None]
    backward: Callable[[], None]
    ran: list[str] = field(default_factory=list)


OverlapFn = Callable[[PairHalves], None]


class PipelineSchedule:
    """Runs training steps of a `PipelineSplit` with a schedule ([Note: one pipeline step]).

    Args:
        split: from `pipeline_split` (after TP / ``fully_shard`` of its stages).
        schedule: a registered name (``SCHEDULES``) or a `ScheduleSpec` of `RUNNABLE_KINDS`.
        microbatches: ``m``; the batch size must be a multiple of it.
        loss_fn: ``loss_fn(output, targets) -> scalar``, mean over the microbatch, on the last stage.
        loss_context: a context manager factory around the loss and its backward (``loss_parallel``).
        reduce_every_microbatch, reshard_between_microbatches: [Note: fully_shard units in a
            pipeline step].
        overlap: ``overlap(pair)`` runs each ``FB`` pair ([Note: forward/backward pairs]).

    ``step`` returns the ``m`` losses (float64 CPU, on every rank); then ``last_timing`` (seconds:
    ``compute_s``, ``compute_cpu_s``, ``send_s``, ``wait_s``, ``step_s``), ``last_action_times[(kind,
    stage)]`` (mean wall and CPU seconds, for `simulate`'s ``costs``), ``last_kept_grad_bytes[stage]``
    and ``last_pair_order``.
    """

    def __init__(self, split: PipelineSplit, *, schedule: str | ScheduleSpec = "1f1b", microbatches: int,
                 loss_fn: Callable, loss_context: Callable | None = None,
                 reduce_every_microbatch: bool = False, reshard_between_microbatches: bool = False,
                 overlap: OverlapFn | None = None) -> None:
        if not isinstance(split, PipelineSplit):
            raise TypeError(f"PipelineSchedule: split must be the PipelineSplit that pipeline_split(model, pp_mesh) "
                            f"returns, got {type(split).__name__}; split the model first")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"pipeline: microbatches={microbatches!r}; it must be a positive int")
        if not callable(loss_fn):
            raise TypeError(f"PipelineSchedule: loss_fn must be a callable loss_fn(output, targets) -> scalar loss "
                            f"(run on the last stage), got {loss_fn!r}")
        self.split = split
        self.m = microbatches
        self.loss_fn = loss_fn
        self.loss_context = loss_context
        self.reduce_every_microbatch = reduce_every_microbatch
        self.reshard_between_microbatches = reshard_between_microbatches
        pp, v = split.pp_size, split.virtual_stages
        spec = get_schedule(schedule)
        self.all_actions = spec.actions(pp, microbatches, v)
        kinds = {a.kind for acts in self.all_actions for a in acts}
        if kinds - RUNNABLE_KINDS:
            raise ValueError(f"pipeline: schedule {spec.name!r} uses action kinds "
                             f"{sorted(k.value for k in kinds - RUNNABLE_KINDS)}, which this runtime cannot run yet "
                             f"(it runs {sorted(k.value for k in RUNNABLE_KINDS)}); use a schedule of those")
        if spec.placement != split.placement:
            raise ValueError(f"pipeline: schedule {spec.name!r} places stages as {spec.placement!r} but the model was "
                             f"split with placement={split.placement!r}; split it with pipeline_split(..., "
                             f"placement={spec.placement!r})")
        if ActionKind.FB in kinds:  # [Note: forward/backward pairs]: the halves never wait on each other
            try:
                simulate(self.all_actions, split.num_stages, microbatches, overlap=1.0)
            except ValueError as exc:
                raise ValueError(f"pipeline: schedule {spec.name!r} cannot run its pairs: {exc}") from None
        self.schedule = spec
        self.overlap: OverlapFn | None = None
        if overlap is not None:
            self.register_custom_function(ActionKind.FB, overlap)
        self.last_pair_order: list[tuple[Action, Action]] = []
        self.actions = self.all_actions[split.pp_rank]
        self.stages = {st.index: st for st in split.stages}
        self.split_caches = {i: SplitCache() for i in self.stages}  # [Note: recorded graph shape]
        self.S = split.num_stages
        self.broken: str | None = None
        self.last_timing: dict[str, float] = {}
        self.last_action_times: dict[tuple[str, int], tuple[float, float]] = {}
        self.last_kept_grad_bytes: dict[int, int] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        for st in split.stages:
            blocks = list(st.blocks)
            if not st.is_first:
                self._hooks.append(blocks[0].register_forward_pre_hook(
                    inject_hook(st), prepend=True, with_kwargs=True))
            if not st.is_last:
                self._hooks.append(blocks[-1].register_forward_hook(capture_hook(st)))
        self._boundary_checked: set[int] = set()
        self.last_b: dict[int, int] = {}  # stage -> index of its last action that makes parameter gradients
        for i, a in enumerate(self.actions):
            for h in a.halves:
                if h.kind in (ActionKind.B, ActionKind.W):
                    self.last_b[h.stage] = i
        param = next((p for p in split.module.parameters()), None)
        self.device = device_of(param)
        self._order: dict[int, tuple[list, list]] | None = None  # peer -> (keys it sends us, we send it)
        self.p2p = (P2P(split.pp_group, self.device, agree_on_tag(split.pp_group, self.device),
                        in_flight=split.in_flight) if pp > 1 else None)

    def register_custom_function(self, kind: ActionKind | str, fn: OverlapFn) -> None:
        """Run every action of ``kind`` with ``fn``; only ``ActionKind.FB`` (pairs) takes one:
        ``fn(pair)`` as the ``overlap`` argument ([Note: forward/backward pairs])."""
        if ActionKind(kind) is not ActionKind.FB:
            raise ValueError(f"PipelineSchedule.register_custom_function: only pairs (ActionKind.FB) take a custom "
                             f"function, not {ActionKind(kind).value}")
        if not callable(fn):
            raise TypeError(f"PipelineSchedule: the overlap function must be a callable fn(pair), got {fn!r}")
        self.overlap = fn

    def close(self) -> None:
        """Remove the hooks this schedule put on the stages' first and last blocks (to build
        another schedule on the same split)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.split.pp_size, self.split.placement)

    def _loss_ctx(self) -> AbstractContextManager[Any]:
        return self.loss_context() if self.loss_context else nullcontext()

    def _get(self, key: tuple, from_stage: int, local: dict) -> torch.Tensor:
        """The input ``key``: handed on within this rank or received ahead by a pair (in
        ``local``), or received from the rank of ``from_stage``."""
        if key in local or self._rank_of(from_stage) == self.split.pp_rank:
            return local.pop(key)
        assert self.p2p is not None, "a one-rank pipeline hands everything on locally"
        return self.p2p.recv(self._rank_of(from_stage), key)

    def _put(self, key: tuple, to_stage: int, tensor: torch.Tensor, local: dict) -> None:
        if self._rank_of(to_stage) == self.split.pp_rank:
            local[key] = tensor.detach()
        else:
            assert self.p2p is not None, "a one-rank pipeline hands everything on locally"
            self.p2p.send(self._rank_of(to_stage), key, tensor)

    def _forward(self, idx: int, a: Action, st: StageShell, step: StepState) -> None:
        """``F(s, i)``: receive (or take) the input, run the stage shell, send the output or
        compute the loss; see [Note: one pipeline step]."""
        step.current = a
        x = None
        if not st.is_first:
            x = self._get(("act", a.stage, a.microbatch), a.stage - 1, step.local)
            x = x.detach().requires_grad_(x.is_floating_point())
        step.x = x
        t0, c0 = time.perf_counter(), time.thread_time()
        st.slot.value, st.slot.out = x, None
        args = step.mb_in[a.microbatch]
        out = st.module(*(args if isinstance(args, tuple) else (args,)))
        st.slot.value = None
        if st.is_last:
            with self._loss_ctx():
                loss = self.loss_fn(out, step.mb_tg[a.microbatch])
            step.saved[(a.stage, a.microbatch)] = (x, loss)
            value = loss.detach()
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            step.losses[a.microbatch] = float(value)
            step.timed(t0, c0, a)
            return
        y, st.slot.out = st.slot.out, None
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"the last block of stage {a.stage} returned no tensor; a pipeline "
                            "boundary carries one tensor (the hidden state)")
        if a.stage not in self._boundary_checked:  # [Note: work between blocks], first step only
            check_boundary(a.stage, first_tensor(out), y)
            self._boundary_checked.add(a.stage)
        step.saved[(a.stage, a.microbatch)] = (x, y)
        step.timed(t0, c0, a)
        self._put(("act", a.stage + 1, a.microbatch), a.stage + 1, y, step.local)

    def _backward(self, idx: int, a: Action, st: StageShell, step: StepState) -> None:
        """``B(s, i)``: backpropagate ``loss_i / m`` (last stage) or the received gradient of the
        stage's output, then send the gradient of its input back."""
        step.current = a
        x, y = step.saved.pop((a.stage, a.microbatch))
        g = None
        if not st.is_last:
            g = self._get(("grad", a.stage, a.microbatch), a.stage + 1, step.local)
        t0, c0 = time.perf_counter(), time.thread_time()
        step.units.before_backward(a.stage, self.last_b[a.stage] == idx)
        if st.is_last:
            with self._loss_ctx():
                torch.autograd.backward(y / self.m)
        else:
            torch.autograd.backward(y, g)
        step.timed(t0, c0, a)
        if not st.is_first:
            if x is None or x.grad is None:
                raise RuntimeError(f"stage {a.stage} produced no gradient for its input activation")
            self._put(("grad", a.stage - 1, a.microbatch), a.stage - 1, x.grad, step.local)

    def _input_grad(self, idx: int, a: Action, st: StageShell, step: StepState) -> None:
        """``I(s, i)``: the gradient of the stage's input only, sent back at once; the graph is
        kept for ``W(s, i)`` ([Note: split backward])."""
        step.current = a
        x, y = step.saved.pop((a.stage, a.microbatch))
        g = None if st.is_last else self._get(("grad", a.stage, a.microbatch), a.stage + 1, step.local)
        t0, c0 = time.perf_counter(), time.thread_time()
        step.units.before_input_grad(a.stage)
        with self._loss_ctx() if st.is_last else nullcontext():
            gx, pending = input_grad([y / self.m] if st.is_last else [y], [g], x, self.split_caches[a.stage])
        step.pending[(a.stage, a.microbatch)] = (x, pending)
        step.timed(t0, c0, a)
        step.kept[a.stage] = max(step.kept.get(a.stage, 0), pending.kept_bytes())
        if not st.is_first:
            if gx is None:
                raise RuntimeError(f"stage {a.stage} produced no gradient for its input activation")
            self._put(("grad", a.stage - 1, a.microbatch), a.stage - 1, gx, step.local)

    def _weight_grad(self, idx: int, a: Action, st: StageShell, step: StepState) -> None:
        """``W(s, i)``: the parameters' gradients from what ``I(s, i)`` kept; after the stage's
        last, its units reduce ([Note: fully_shard units in a pipeline step])."""
        step.current = a
        x, pending = step.pending.pop((a.stage, a.microbatch))
        t0, c0 = time.perf_counter(), time.thread_time()
        step.units.before_weight_grad(a.stage, self.last_b[a.stage] == idx)
        with self._loss_ctx() if st.is_last else nullcontext():
            weight_grad(pending, x)
        step.units.after_weight_grad(a.stage)
        step.timed(t0, c0, a)

    def _sends_of(self, rank: int) -> list:
        """(destination rank, key) of every message rank ``rank`` sends in a step, in its order."""
        out = []
        for a in (h for x in self.all_actions[rank] for h in x.halves):  # a pair: its forward's first
            if a.kind.is_forward and a.stage + 1 < self.S and self._rank_of(a.stage + 1) != rank:
                out.append((self._rank_of(a.stage + 1), ("act", a.stage + 1, a.microbatch)))
            if a.kind.gives_input_grad and a.stage > 0 and self._rank_of(a.stage - 1) != rank:
                out.append((self._rank_of(a.stage - 1), ("grad", a.stage - 1, a.microbatch)))
        return out

    def _expect(self) -> None:
        """Tell the transport what each peer will send us, and we it, in order."""
        if self._order is None:
            me, pp = self.split.pp_rank, self.split.pp_size
            mine = self._sends_of(me)
            self._order = {peer: ([k for d, k in self._sends_of(peer) if d == me], [k for d, k in mine if d == peer])
                           for peer in {(me - 1) % pp, (me + 1) % pp} - {me}}
        assert self.p2p is not None, "only a pipeline of more than one rank expects messages"
        for peer, (keys, sends) in self._order.items():
            self.p2p.expect(peer, keys, sends)

    def _receives(self, a: Action) -> bool:
        """Whether action ``a`` (or a half of pair ``a``) takes a message from another rank."""
        if a.kind is ActionKind.FB:
            return any(self._receives(h) for h in a.halves)
        if a.kind is ActionKind.W:
            return False
        if a.kind.is_forward:
            return a.stage > 0 and self._rank_of(a.stage - 1) != self.split.pp_rank
        return a.stage < self.S - 1 and self._rank_of(a.stage + 1) != self.split.pp_rank

    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """One training step (forward and backward of every microbatch); gradients accumulate into
        ``.grad`` as ``loss.backward()`` would. See [Note: one pipeline step]."""
        if self.broken:
            raise PipelineError(f"pipeline: a previous step failed ({self.broken}); build a new PipelineSchedule")
        mb_in = split_batch(inputs, self.m, "inputs")
        mb_tg = split_batch(targets, self.m, "targets")
        if self.p2p is not None:
            self._expect()
        losses = torch.zeros(self.m, dtype=torch.float64)
        self.last_pair_order = []
        units = StageUnits({i: st.module for i, st in self.stages.items()},
                           keep=not self.reshard_between_microbatches, every_microbatch=self.reduce_every_microbatch)
        t_start = time.perf_counter()
        p2p0 = (self.p2p.send_s, self.p2p.wait_s) if self.p2p is not None else (0.0, 0.0)
        try:
            error, done = self._run_actions(mb_in, mb_tg, losses, units)
        except BaseException:  # KeyboardInterrupt...: settings back (no collective), no more steps
            units.restore()
            self.broken = "interrupted"
            raise
        finally:
            for st in self.split.stages:
                st.slot.value = st.slot.out = None
        if error:
            units.abandon()  # see [Note: fully_shard units in a pipeline step]
        else:
            units.restore()
        return self._finish(losses, error, done, t_start, p2p0)

    def _run_actions(self, mb_in: list, mb_tg: list, losses: torch.Tensor,
                     units: StageUnits) -> tuple[str | None, StepState]:
        """Run this rank's action list, dispatching on each action's `ActionKind`; returns (the
        error text or None, the step's state: its times)."""
        run = {ActionKind.F: self._forward, ActionKind.B: self._backward, ActionKind.I: self._input_grad,
               ActionKind.W: self._weight_grad, ActionKind.FB: self._pair}
        step = StepState(mb_in, mb_tg, losses, units)
        error: str | None = None
        for idx, a in enumerate(self.actions):
            step.x, step.current = None, None
            try:
                if self.p2p is not None and not self._receives(a):
                    self.p2p.flush()  # see [Note: messages between stages]
                run[a.kind](idx, a, self.stages[a.stage], step)
            except PeerFailed as exc:
                error = str(exc)
                self._notify(error)
                break
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                first = (str(exc).strip().splitlines() or [""])[0]
                cur = step.current or a
                error = (f"pipeline stage {cur.stage} (pp rank {self.split.pp_rank}) failed in "
                         f"{PHASE[cur.kind]} of microbatch {cur.microbatch}: {type(exc).__name__}: {first}")
                if cur.kind is ActionKind.F and isinstance(step.x, torch.Tensor):
                    error += (f" (its input, from stage {cur.stage - 1}, has shape {tuple(step.x.shape)} and dtype "
                              f"{step.x.dtype}: check that stage boundaries carry what the next block takes)")
                self._notify(error)
                break
        return error, step

    def _notify(self, text: str) -> None:
        if self.p2p is None:
            return
        me, pp = self.split.pp_rank, self.split.pp_size
        for peer in {(me - 1) % pp, (me + 1) % pp} - {me}:
            self.p2p.send_error(peer, text)

    def _source(self, h: Action) -> tuple[str, tuple, int]:
        """Where half ``h``'s input comes from: ``("none" | "local" | "peer", key, peer rank)``."""
        if h.kind is ActionKind.F:
            key, src = ("act", h.stage, h.microbatch), h.stage - 1
            if h.stage == 0:
                return "none", key, -1
        else:
            key, src = ("grad", h.stage, h.microbatch), h.stage + 1
            if h.stage == self.S - 1:
                return "none", key, -1
        peer = self._rank_of(src)
        return ("local" if peer == self.split.pp_rank else "peer"), key, peer

    def _there(self, h: Action, step: StepState) -> bool:
        where, key, peer = self._source(h)
        if where != "peer" or key in step.local:
            return True
        assert self.p2p is not None
        return self.p2p.arrived(peer, key)

    def _first_half(self, a: Action, step: StepState) -> int:
        """Which half (0: the forward, 1: the backward) runs first."""
        for n, h in enumerate(a.halves):
            if self._there(h, step):
                return n
        (_, kf, pf), (_, kb, pb) = (self._source(h) for h in a.halves)
        assert self.p2p is not None, "both halves wait for a peer"
        if pf == pb:
            return 0 if self.p2p.sent_before(pf, kf, kb) else 1
        if not self.p2p.ahead:
            return 0
        self.p2p.flush()  # nothing of ours may wait while we wait
        return self.p2p.wait_first([(pf, kf), (pb, kb)])

    def _pair(self, idx: int, a: Action, st: StageShell, step: StepState) -> None:
        run = {ActionKind.F: self._forward, ActionKind.B: self._backward, ActionKind.I: self._input_grad}
        if self.overlap is not None:
            self._overlapped(idx, a, step, run)
            return
        first = self._first_half(a, step)
        one, two = a.halves[first], a.halves[1 - first]
        self.last_pair_order.append((one, two))
        run[one.kind](idx, one, self.stages[one.stage], step)
        where, key, peer = self._source(two)
        if self.p2p is not None and (where != "peer" or key in step.local or self.p2p.arrived(peer, key)):
            self.p2p.flush()  # else the receive of `two` sends the output of `one` in its group
        run[two.kind](idx, two, self.stages[two.stage], step)

    def _overlapped(self, idx: int, a: Action, step: StepState, run: dict) -> None:
        for h in sorted(a.halves, key=lambda h: 0 if self._there(h, step) else 1):
            where, key, peer = self._source(h)
            if where == "peer" and key not in step.local:
                step.local[key] = self._get(key, h.stage - 1 if h.kind is ActionKind.F else h.stage + 1, step.local)

        def half(n: int, name: str) -> Callable[[], None]:
            def go() -> None:
                h = a.halves[n]
                if name in halves.ran:
                    raise RuntimeError(f"the overlap function ran the {name} {h!r} of pair {a!r} twice; run "
                                       "pair.forward() and pair.backward() once each")
                halves.ran.append(name)
                run[h.kind](idx, h, self.stages[h.stage], step)
                if self.p2p is not None:
                    self.p2p.flush()
            return go

        halves = PairHalves(a, half(0, "forward"), half(1, "backward"))
        assert self.overlap is not None
        self.overlap(halves)
        step.current = a
        missing = [n for n in ("forward", "backward") if n not in halves.ran]
        if missing:
            raise RuntimeError(f"the overlap function returned without running the {' and '.join(missing)} of pair "
                               f"{a!r}; it must call pair.forward() and pair.backward() once each")
        self.last_pair_order.append((a.halves[0], a.halves[1]) if halves.ran[0] == "forward"
                                    else (a.halves[1], a.halves[0]))

    def _finish(self, losses: torch.Tensor, error: str | None, done: StepState, t_start: float,
                p2p0: tuple[float, float]) -> torch.Tensor:
        if self.p2p is None:
            if error:
                self.broken = error
                raise PipelineError(error)
            self._timing(done, t_start, 0.0, 0.0)
            return losses
        if not error:
            self.p2p.flush()  # the step's last sends, before anyone waits in the all-reduce
        status = torch.cat([torch.tensor([1.0 if error else 0.0], dtype=torch.float64), losses]).to(self.device)
        if not self.stages.get(self.S - 1):
            status[1:] = 0
        t_end = time.perf_counter()  # the closing all-reduce waits for the last rank to finish
        dist.all_reduce(status, group=self.split.pp_group)
        end_wait = time.perf_counter() - t_end
        status = status.cpu()
        if status[0] > 0:
            texts: list[str | None] = [None] * self.split.pp_size
            dist.all_gather_object(texts, error, group=self.split.pp_group)
            self.p2p.drop()
            message = next(t for t in texts if t)
            self.broken = message
            raise PipelineError(message)
        self.p2p.wait_sends()
        self._timing(done, t_start, self.p2p.send_s - p2p0[0], self.p2p.wait_s - p2p0[1] + end_wait)
        return status[1:].clone()

    def _timing(self, done: StepState, t_start: float, sent: float, waited: float) -> None:
        self.last_timing = {"compute_s": done.compute, "compute_cpu_s": done.cpu, "send_s": sent,
                            "wait_s": waited, "step_s": time.perf_counter() - t_start}
        self.last_action_times = {k: (v[0] / v[2], v[1] / v[2]) for k, v in done.per_action.items()}
        self.last_kept_grad_bytes = dict(done.kept)
