"""``PipelineSchedule``: run one training step of a split model over microbatches.

[Note: one pipeline step]
``step(inputs, targets)`` cuts the batch into ``m`` equal microbatches along dim 0 and runs this
rank's action list (`build_schedule`). ``F(s, i)``: take the activation of microbatch ``i`` from
stage ``s - 1`` (or, on stage 0, nothing), call stage ``s``'s shell on the microbatch's model
inputs, and send the output of its last block on; the last stage computes
``loss_fn(output, targets_i)`` instead. ``B(s, i)``: the last stage backpropagates
``loss_i / m``, the others the received gradient of their output; then the gradient of the
stage's input goes back. ``I(s, i)`` and ``W(s, i)`` split ``B`` in two: ``I`` sends the input
gradient back at once and keeps the graph, ``W`` later accumulates the parameters' gradients
from it ([Note: split backward] in ``_split_backward.py``). ``FB`` runs a pair: a forward and a
backward of two other (stage, microbatch)s, in the order their inputs arrive or inside the user's
overlap function ([Note: forward/backward pairs] in ``_pairs.py``). With mean-reduced losses over
equal microbatches the accumulated gradients are those of the whole batch on one process.

Files: this one holds `PipelineSchedule` (set-up, the messages of a step, the step and its end);
``_bodies.py`` the body of each action kind, ``_pairs.py`` pairs, ``_step_state.py`` what a
step's actions share.

``fully_shard`` units: one reduce-scatter per unit per step and, by default, one all-gather;
see [Note: fully_shard units in a pipeline step] in ``_units.py``.

End of step: one small all-reduce on the ``pp`` group carries a failure flag and the
microbatch losses (so every rank returns them). A rank whose action raised first sends the
error to its pipeline neighbours ([Note: messages between stages]), then joins that
all-reduce, so every rank raises the same ``PipelineError`` instead of hanging.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ._actions import Action, ActionKind
from ._bodies import PHASE
from ._graph_split import SplitCache
from ._p2p import P2P, PeerFailed
from ._pairs import OverlapFn, PairRunner
from ._registry import ScheduleSpec, get_schedule
from ._schedule import simulate
from ._stages import PipelineSplit
from ._step_state import PipelineError, StepState, agree_on_tag, capture_hook, device_of, inject_hook, split_batch
from ._units import StageUnits

__all__ = ["PipelineError", "PipelineSchedule", "RUNNABLE_KINDS"]


class PipelineSchedule(PairRunner):
    """Runs training steps of a `PipelineSplit` with a schedule.

    Args:
        split: from `pipeline_split` (after TP / ``fully_shard`` of its stages).
        schedule: a registered schedule's name (``SCHEDULES``: ``"gpipe"``, ``"1f1b"``,
            ``"interleaved_1f1b"``, which needs ``microbatches % pp == 0``, ``"zb_h1"``, ...) or
            a `ScheduleSpec`. Its actions are of the kinds in `RUNNABLE_KINDS` (F, B, the
            split backward's I and W, and FB pairs).
        microbatches: ``m``; the batch size must be a multiple of it.
        loss_fn: ``loss_fn(output, targets) -> scalar`` on the last stage, mean-reduced over the
            microbatch (the step backpropagates ``loss / m``).
        loss_context: a context manager factory entered around the loss and its backward
            (e.g. ``shardwise.composable.loss_parallel`` for class-sharded logits).
        reduce_every_microbatch: reduce gradients after every microbatch's backward instead of
            once per step; see [Note: fully_shard units in a pipeline step].
        reshard_between_microbatches: free ``fully_shard`` units' gathered parameters after every
            microbatch's forward and backward (less memory, ``2 m`` all-gathers per unit per
            step) instead of keeping them gathered for the step; see [Note: fully_shard units in a pipeline step].
        overlap: ``overlap(pair)``, called to run each forward/backward pair (``FB``) of the
            schedule, e.g. to overlap one half's communication with the other's compute; it gets
            a `PairHalves` and must call ``pair.forward()`` and ``pair.backward()`` once each.
            None: the halves run one after the other, whichever's input is there first. Also
            settable with ``register_custom_function(ActionKind.FB, fn)``. See [Note:
            forward/backward pairs].

    ``step(inputs, targets)`` returns the ``m`` microbatch losses (a float64 CPU tensor, the
    same on every rank); ``last_timing`` then holds this rank's ``compute_s`` (wall time inside
    forward/backward), ``compute_cpu_s`` (the CPU time of this thread in them, which other load
    on the machine disturbs less), ``send_s`` (wall time issuing sends between actions: busy, not
    idle), ``wait_s`` (wall time waiting for messages and, in the step's closing all-reduce, for
    the other ranks: the idle time) and ``step_s``; ``last_action_times[(kind, stage)]`` the mean
    wall and CPU seconds of this rank's actions of that kind (``"F"``, ``"B"``, ``"I"``, ``"W"``)
    on that stage (for `simulate`'s ``costs``); ``last_kept_grad_bytes[stage]`` the most bytes of
    gradients one ``I`` of the stage kept for its ``W`` (see `activations_in_flight`'s ``kept_grads``);
    ``last_pair_order`` the halves of this rank's pairs in the order they ran (a pair's halves are
    timed under their own kinds).
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
        self.overlap = None
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
        self._hooks: list = []
        for st in split.stages:
            blocks = list(st.blocks)
            if not st.is_first:
                self._hooks.append(blocks[0].register_forward_pre_hook(
                    inject_hook(st), prepend=True, with_kwargs=True))
            if not st.is_last:
                self._hooks.append(blocks[-1].register_forward_hook(capture_hook(st)))
        self._boundary_checked: set[int] = set()
        self.last_b = {}  # stage -> index of its last action that makes parameter gradients
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

    def step(self, inputs, targets=None) -> torch.Tensor:
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
            error, timing = self._run_actions(mb_in, mb_tg, losses, units)
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
        return self._finish(losses, error, timing, t_start, p2p0)

    def _run_actions(self, mb_in, mb_tg, losses, units: StageUnits):
        """Run this rank's action list, dispatching on each action's `ActionKind`; returns (the
        error text or None, (compute s, compute CPU s))."""
        run = {ActionKind.F: self._forward, ActionKind.B: self._backward, ActionKind.I: self._input_grad,
               ActionKind.W: self._weight_grad, ActionKind.FB: self._pair}
        step = StepState(mb_in, mb_tg, losses, units)
        error = None
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
        return error, (step.compute, step.cpu, step.per_action, step.kept)

    def _notify(self, text: str) -> None:
        if self.p2p is None:
            return
        me, pp = self.split.pp_rank, self.split.pp_size
        for peer in {(me - 1) % pp, (me + 1) % pp} - {me}:
            self.p2p.send_error(peer, text)

    def _finish(self, losses, error, compute, t_start, p2p0: tuple[float, float]) -> torch.Tensor:
        if self.p2p is None:
            if error:
                self.broken = error
                raise PipelineError(error)
            self._timing(compute, t_start, 0.0, 0.0)
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
            texts = [None] * self.split.pp_size
            dist.all_gather_object(texts, error, group=self.split.pp_group)
            self.p2p.drop()
            message = next(t for t in texts if t)
            self.broken = message
            raise PipelineError(message)
        self.p2p.wait_sends()
        self._timing(compute, t_start, self.p2p.send_s - p2p0[0], self.p2p.wait_s - p2p0[1] + end_wait)
        return status[1:].clone()

    def _timing(self, compute, t_start: float, sent: float, waited: float) -> None:
        self.last_timing = {"compute_s": compute[0], "compute_cpu_s": compute[1], "send_s": sent,
                            "wait_s": waited, "step_s": time.perf_counter() - t_start}
        self.last_action_times = {k: (v[0] / v[2], v[1] / v[2]) for k, v in compute[2].items()}
        self.last_kept_grad_bytes = dict(compute[3])


RUNNABLE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.FB})
"""The action kinds this runtime executes; a schedule with others is refused when it is built."""
