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
from it ([Note: split backward] in ``_split_backward.py``). With mean-reduced losses over equal microbatches the accumulated
gradients are those of the whole batch on one process.

``fully_shard`` units: one reduce-scatter per unit per step and, by default, one all-gather;
see [Note: fully_shard units in a pipeline step] in ``_units.py``.

End of step: one small all-reduce on the ``pp`` group carries a failure flag and the
microbatch losses (so every rank returns them). A rank whose action raised first sends the
error to its pipeline neighbours ([Note: messages between stages]), then joins that
all-reduce, so every rank raises the same ``PipelineError`` instead of hanging.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ._boundary import check_boundary
from ._p2p import P2P, PeerFailed
from ._placement import stage_rank
from ._registry import ScheduleSpec, get_schedule
from ._schedule import Action, ActionKind
from ._graph_split import SplitCache
from ._split import StageShell
from ._split_backward import input_grad, weight_grad
from ._stages import PipelineSplit
from ._units import StageUnits

__all__ = ["PipelineError", "PipelineSchedule", "RUNNABLE_KINDS"]


class PipelineError(RuntimeError):
    """A pipeline step failed on some rank; raised on every rank with the same message."""


def _split_batch(x, m: int, what: str):
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or x.shape[0] % m:
            n = x.shape[0] if x.dim() else 0
            raise ValueError(f"pipeline: {what} has batch size {n}, not divisible by microbatches={m}; use a batch "
                             f"size that is a multiple of {m}, or another number of microbatches")
        return list(x.chunk(m, dim=0))
    if isinstance(x, (tuple, list)):
        parts = [_split_batch(t, m, what) if isinstance(t, torch.Tensor) else [t] * m for t in x]
        return [tuple(p[i] for p in parts) for i in range(m)]
    if x is None:
        return [None] * m
    raise TypeError(f"pipeline: {what} must be a tensor or a tuple of tensors, got {type(x).__name__}")


def _first_tensor(out):
    """The tensor a block hands on: itself, or the first tensor of a tuple/list/dict output."""
    if isinstance(out, torch.Tensor):
        return out
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for x in items:
        t = _first_tensor(x)
        if t is not None:
            return t
    return None


class PipelineSchedule:
    """Runs training steps of a `PipelineSplit` with a schedule.

    Args:
        split: from `pipeline_split` (after TP / ``fully_shard`` of its stages).
        schedule: a registered schedule's name (``SCHEDULES``: ``"gpipe"``, ``"1f1b"``,
            ``"interleaved_1f1b"``, which needs ``microbatches % pp == 0``, ``"zb_h1"``, ...) or
            a `ScheduleSpec`. Its actions are of the kinds in `RUNNABLE_KINDS` (F, B, and the
            split backward's I and W).
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

    ``step(inputs, targets)`` returns the ``m`` microbatch losses (a float64 CPU tensor, the
    same on every rank); ``last_timing`` then holds this rank's ``compute_s`` (wall time inside
    forward/backward), ``compute_cpu_s`` (the CPU time of this thread in them, which other load
    on the machine disturbs less) and ``step_s``; ``last_action_times[(kind, stage)]`` the mean
    wall and CPU seconds of this rank's actions of that kind (``"F"``, ``"B"``, ``"I"``, ``"W"``)
    on that stage (for `simulate`'s ``costs``); ``last_kept_grad_bytes[stage]`` the most bytes of
    gradients one ``I`` of the stage kept for its ``W`` (see `activations_in_flight`'s ``kept_grads``).
    """

    def __init__(self, split: PipelineSplit, *, schedule: str | ScheduleSpec = "1f1b", microbatches: int,
                 loss_fn: Callable, loss_context: Callable | None = None,
                 reduce_every_microbatch: bool = False, reshard_between_microbatches: bool = False) -> None:
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
                             f"(it runs {sorted(k.value for k in RUNNABLE_KINDS)}: forward and full backward); "
                             "use a schedule of F and B actions")
        if spec.placement != split.placement:
            raise ValueError(f"pipeline: schedule {spec.name!r} places stages as {spec.placement!r} but the model was "
                             f"split with placement={split.placement!r}; split it with pipeline_split(..., "
                             f"placement={spec.placement!r})")
        self.schedule = spec
        self.actions = self.all_actions[split.pp_rank]
        self.stages = {st.index: st for st in split.stages}
        self.split_caches = {i: SplitCache() for i in self.stages}  # [Note: recorded graph shape]
        self.S = split.num_stages
        self.broken: str | None = None
        self.last_timing: dict[str, float] = {}
        self.last_action_times: dict[tuple[str, int], tuple[float, float]] = {}
        self.last_kept_grad_bytes: dict[int, int] = {}
        self._hooks = []
        for st in split.stages:
            blocks = list(st.blocks)
            if not st.is_first:
                self._hooks.append(blocks[0].register_forward_pre_hook(
                    self._make_inject(st), prepend=True, with_kwargs=True))
            if not st.is_last:
                self._hooks.append(blocks[-1].register_forward_hook(self._make_capture(st)))
        self._boundary_checked: set[int] = set()
        self.last_b = {}  # stage -> index of its last action that makes parameter gradients
        for i, a in enumerate(self.actions):
            if a.kind in (ActionKind.B, ActionKind.W):
                self.last_b[a.stage] = i
        param = next((p for p in split.module.parameters()), None)
        self.device = _device_of(param)
        self._order: dict[int, tuple[list, list]] | None = None  # peer -> (keys it sends us, we send it)
        self.p2p = (P2P(split.pp_group, self.device, _agree_on_tag(split.pp_group, self.device),
                        in_flight=split.in_flight) if pp > 1 else None)

    def close(self) -> None:
        """Remove the hooks this schedule put on the stages' first and last blocks (to build
        another schedule on the same split)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @staticmethod
    def _make_inject(st):
        def hook(mod, args, kwargs):
            if st.slot.value is None:
                return None
            if not args:
                raise RuntimeError(f"pipeline: the first block of stage {st.index} got no positional argument to "
                                   "take the previous stage's activation")
            return (st.slot.value, *args[1:]), kwargs
        return hook

    @staticmethod
    def _make_capture(st):
        def hook(mod, args, out):
            st.slot.out = _first_tensor(out)
        return hook

    def _rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.split.pp_size, self.split.placement)

    def _sends_of(self, rank: int) -> list:
        """(destination rank, key) of every message rank ``rank`` sends in a step, in its order."""
        out = []
        for a in self.all_actions[rank]:
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
        """Whether action ``a`` takes a message from another rank."""
        if a.kind is ActionKind.W:
            return False
        if a.kind.is_forward:
            return a.stage > 0 and self._rank_of(a.stage - 1) != self.split.pp_rank
        return a.stage < self.S - 1 and self._rank_of(a.stage + 1) != self.split.pp_rank

    def _get(self, key, from_stage, local):
        if self._rank_of(from_stage) == self.split.pp_rank:
            return local.pop(key)
        return self.p2p.recv(self._rank_of(from_stage), key)

    def _put(self, key, to_stage, tensor, local):
        if self._rank_of(to_stage) == self.split.pp_rank:
            local[key] = tensor.detach()
        else:
            self.p2p.send(self._rank_of(to_stage), key, tensor)

    def step(self, inputs, targets=None) -> torch.Tensor:
        """One training step (forward and backward of every microbatch); gradients accumulate into
        ``.grad`` as ``loss.backward()`` would. See [Note: one pipeline step]."""
        if self.broken:
            raise PipelineError(f"pipeline: a previous step failed ({self.broken}); build a new PipelineSchedule")
        mb_in = _split_batch(inputs, self.m, "inputs")
        mb_tg = _split_batch(targets, self.m, "targets")
        if self.p2p is not None:
            self._expect()
        losses = torch.zeros(self.m, dtype=torch.float64)
        units = StageUnits({i: st.module for i, st in self.stages.items()},
                           keep=not self.reshard_between_microbatches, every_microbatch=self.reduce_every_microbatch)
        t_start = time.perf_counter()
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
        return self._finish(losses, error, timing, t_start)

    def _run_actions(self, mb_in, mb_tg, losses, units: StageUnits):
        """Run this rank's action list, dispatching on each action's `ActionKind`; returns (the
        error text or None, (compute s, compute CPU s))."""
        run = {ActionKind.F: self._forward, ActionKind.B: self._backward, ActionKind.I: self._input_grad,
               ActionKind.W: self._weight_grad}
        step = _StepState(mb_in, mb_tg, losses, units)
        error = None
        for idx, a in enumerate(self.actions):
            step.x = None
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
                error = (f"pipeline stage {a.stage} (pp rank {self.split.pp_rank}) failed in "
                         f"{_PHASE[a.kind]} of microbatch {a.microbatch}: {type(exc).__name__}: {first}")
                if a.kind is ActionKind.F and isinstance(step.x, torch.Tensor):
                    error += (f" (its input, from stage {a.stage - 1}, has shape {tuple(step.x.shape)} and dtype "
                              f"{step.x.dtype}: check that stage boundaries carry what the next block takes)")
                self._notify(error)
                break
        return error, (step.compute, step.cpu, step.per_action, step.kept)

    def _forward(self, idx: int, a: Action, st: StageShell, step: _StepState) -> None:
        """``F(s, i)``: receive (or take) the input, run the stage shell, send the output or
        compute the loss; see [Note: one pipeline step]."""
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
            ctx = self.loss_context() if self.loss_context else _null()
            with ctx:
                loss = self.loss_fn(out, step.mb_tg[a.microbatch])
            step.saved[(a.stage, a.microbatch)] = (x, loss)
            value = loss.detach()
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            step.losses[a.microbatch] = float(value)
            step.timed(t0, c0, a)
            return
        y = st.slot.out
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"the last block of stage {a.stage} returned no tensor; a pipeline "
                            "boundary carries one tensor (the hidden state)")
        if a.stage not in self._boundary_checked:  # [Note: work between blocks], first step only
            check_boundary(a.stage, _first_tensor(out), y)
            self._boundary_checked.add(a.stage)
        step.saved[(a.stage, a.microbatch)] = (x, y)
        step.timed(t0, c0, a)
        self._put(("act", a.stage + 1, a.microbatch), a.stage + 1, y, step.local)

    def _backward(self, idx: int, a: Action, st: StageShell, step: _StepState) -> None:
        """``B(s, i)``: backpropagate ``loss_i / m`` (last stage) or the received gradient of the
        stage's output, then send the gradient of its input back."""
        x, y = step.saved.pop((a.stage, a.microbatch))
        g = None
        if not st.is_last:
            g = self._get(("grad", a.stage, a.microbatch), a.stage + 1, step.local)
        t0, c0 = time.perf_counter(), time.thread_time()
        step.units.before_backward(a.stage, self.last_b[a.stage] == idx)
        if st.is_last:
            ctx = self.loss_context() if self.loss_context else _null()
            with ctx:
                torch.autograd.backward(y / self.m)
        else:
            torch.autograd.backward(y, g)
        step.timed(t0, c0, a)
        if not st.is_first:
            if x is None or x.grad is None:
                raise RuntimeError(f"stage {a.stage} produced no gradient for its input activation")
            self._put(("grad", a.stage - 1, a.microbatch), a.stage - 1, x.grad, step.local)

    def _input_grad(self, idx: int, a: Action, st: StageShell, step: _StepState) -> None:
        """``I(s, i)``: the gradient of the stage's input only, sent back at once; the graph is
        kept for ``W(s, i)`` ([Note: split backward])."""
        x, y = step.saved.pop((a.stage, a.microbatch))
        g = None if st.is_last else self._get(("grad", a.stage, a.microbatch), a.stage + 1, step.local)
        t0, c0 = time.perf_counter(), time.thread_time()
        step.units.before_input_grad(a.stage)
        with self.loss_context() if st.is_last and self.loss_context else _null():
            gx, pending = input_grad([y / self.m] if st.is_last else [y], [g], x, self.split_caches[a.stage])
        step.pending[(a.stage, a.microbatch)] = (x, pending)
        step.timed(t0, c0, a)
        step.kept[a.stage] = max(step.kept.get(a.stage, 0), pending.kept_bytes())
        if not st.is_first:
            if gx is None:
                raise RuntimeError(f"stage {a.stage} produced no gradient for its input activation")
            self._put(("grad", a.stage - 1, a.microbatch), a.stage - 1, gx, step.local)

    def _weight_grad(self, idx: int, a: Action, st: StageShell, step: _StepState) -> None:
        """``W(s, i)``: the parameters' gradients from what ``I(s, i)`` kept; after the stage's
        last, its units reduce ([Note: fully_shard units in a pipeline step])."""
        x, pending = step.pending.pop((a.stage, a.microbatch))
        t0, c0 = time.perf_counter(), time.thread_time()
        step.units.before_weight_grad(a.stage, self.last_b[a.stage] == idx)
        with self.loss_context() if st.is_last and self.loss_context else _null():
            weight_grad(pending, x)
        step.units.after_weight_grad(a.stage)
        step.timed(t0, c0, a)

    def _notify(self, text: str) -> None:
        if self.p2p is None:
            return
        me, pp = self.split.pp_rank, self.split.pp_size
        for peer in {(me - 1) % pp, (me + 1) % pp} - {me}:
            self.p2p.send_error(peer, text)

    def _finish(self, losses, error, compute, t_start) -> torch.Tensor:
        if self.p2p is None:
            if error:
                self.broken = error
                raise PipelineError(error)
            self._timing(compute, t_start)
            return losses
        if not error:
            self.p2p.flush()  # the step's last sends, before anyone waits in the all-reduce
        status = torch.cat([torch.tensor([1.0 if error else 0.0], dtype=torch.float64), losses]).to(self.device)
        if not self.stages.get(self.S - 1):
            status[1:] = 0
        dist.all_reduce(status, group=self.split.pp_group)
        status = status.cpu()
        if status[0] > 0:
            texts = [None] * self.split.pp_size
            dist.all_gather_object(texts, error, group=self.split.pp_group)
            self.p2p.drop()
            message = next(t for t in texts if t)
            self.broken = message
            raise PipelineError(message)
        self.p2p.wait_sends()
        self._timing(compute, t_start)
        return status[1:].clone()

    def _timing(self, compute, t_start: float) -> None:
        self.last_timing = {"compute_s": compute[0], "compute_cpu_s": compute[1],
                            "step_s": time.perf_counter() - t_start}
        self.last_action_times = {k: (v[0] / v[2], v[1] / v[2]) for k, v in compute[2].items()}
        self.last_kept_grad_bytes = dict(compute[3])


_PHASE = {ActionKind.F: "forward", ActionKind.B: "backward", ActionKind.I: "input-gradient backward",
          ActionKind.W: "weight-gradient backward"}
RUNNABLE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
"""The action kinds this runtime executes; a schedule with others is refused when it is built."""


class _StepState:
    """What the actions of one step share: the microbatches, losses, saved activations, local
    hand-offs between stages of this rank, and the compute time so far."""

    def __init__(self, mb_in: list, mb_tg: list, losses: torch.Tensor, units: StageUnits) -> None:
        self.mb_in, self.mb_tg, self.losses, self.units = mb_in, mb_tg, losses, units
        self.local: dict = {}
        self.saved: dict = {}
        self.pending: dict = {}  # (stage, microbatch) -> what I kept for W
        self.x: torch.Tensor | None = None  # the current forward's input, for the error message
        self.compute = self.cpu = 0.0
        self.per_action: dict[tuple[str, int], list[float]] = {}  # (kind, stage) -> [wall s, CPU s, count]
        self.kept: dict[int, int] = {}  # stage -> most bytes of gradients one I kept for its W

    def timed(self, t0: float, c0: float, a: Action) -> None:
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        self.compute += wall
        self.cpu += cpu
        acc = self.per_action.setdefault((a.kind.value, a.stage), [0.0, 0.0, 0])
        acc[0] += wall
        acc[1] += cpu
        acc[2] += 1


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _agree_on_tag(group, device: torch.device) -> int:
    """A random message tag for a new schedule, drawn by the group's first rank and broadcast
    (see [Note: messages between stages]). The broadcast is also the group's first collective:
    NCCL needs every rank of a group in its first batched point-to-point call, and a collective
    first sets up the group's communicator on all of them."""
    tag = torch.tensor([int.from_bytes(os.urandom(4), "little") % (2**31 - 1) + 1], dtype=torch.int64)
    tag = tag.to(device)
    dist.broadcast(tag, group=group, group_src=0)
    return int(tag.item())


def _device_of(param) -> torch.device:
    if param is None:
        return torch.device("cpu")
    local = param.to_local() if hasattr(param, "to_local") else param
    if local.device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return local.device
