"""The body of each action kind of a pipeline step (F, B, I, W), and how an action takes its
input and hands on its output ([Note: one pipeline step] in ``_runtime.py``).

`ActionBodies` is a base of `PipelineSchedule`; it holds no state of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ._actions import Action, ActionKind
from ._boundary import check_boundary
from ._graph_split import SplitCache
from ._p2p import P2P
from ._placement import stage_rank
from ._split import StageShell
from ._split_backward import input_grad, weight_grad
from ._stages import PipelineSplit
from ._step_state import NullContext, StepState, first_tensor

__all__ = ["PHASE", "ActionBodies"]

PHASE = {ActionKind.F: "forward", ActionKind.B: "backward", ActionKind.I: "input-gradient backward",
         ActionKind.W: "weight-gradient backward", ActionKind.FB: "forward/backward pair"}
"""What an action kind is called in error messages."""


class ActionBodies:
    """``_forward``, ``_backward``, ``_input_grad``, ``_weight_grad``: one action each,
    ``(index in this rank's list, action, its stage's shell, the step's state)``."""

    split: PipelineSplit
    m: int
    loss_fn: Callable
    loss_context: Callable | None
    split_caches: dict[int, SplitCache]
    last_b: dict[int, int]
    _boundary_checked: set[int]
    p2p: P2P | None

    def _rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.split.pp_size, self.split.placement)

    def _loss_ctx(self) -> Any:
        return self.loss_context() if self.loss_context else NullContext()

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
        with self._loss_ctx() if st.is_last else NullContext():
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
        with self._loss_ctx() if st.is_last else NullContext():
            weight_grad(pending, x)
        step.units.after_weight_grad(a.stage)
        step.timed(t0, c0, a)
