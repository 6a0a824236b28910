"""What the actions of one pipeline step share (`StepState`), and `PipelineSchedule`'s small helpers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._schedules import Action
from ._units import StageUnits

__all__ = ["PipelineError", "StepState", "agree_on_tag", "capture_hook", "device_of", "first_tensor",
           "inject_hook", "split_batch"]


class PipelineError(RuntimeError):
    """A pipeline step failed on some rank; raised on every rank with the same message."""


def split_batch(x: Any, m: int, what: str) -> list:
    """``x`` (a tensor, a tuple of tensors and other values, or None) cut into ``m`` microbatches along dim 0."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or x.shape[0] % m:
            n = x.shape[0] if x.dim() else 0
            raise ValueError(f"pipeline: {what} has batch size {n}, not divisible by microbatches={m}; use a batch "
                             f"size that is a multiple of {m}, or another number of microbatches")
        return list(x.chunk(m, dim=0))
    if isinstance(x, (tuple, list)):
        parts = [split_batch(t, m, what) if isinstance(t, torch.Tensor) else [t] * m for t in x]
        return [tuple(p[i] for p in parts) for i in range(m)]
    if x is None:
        return [None] * m
    raise TypeError(f"pipeline: {what} must be a tensor or a tuple of tensors, got {type(x).__name__}")


def first_tensor(out: Any) -> torch.Tensor | None:
    """The tensor a block hands on: itself, or the first tensor of a tuple/list/dict output."""
    if isinstance(out, torch.Tensor):
        return out
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for x in items:
        t = first_tensor(x)
        if t is not None:
            return t
    return None


def inject_hook(st: Any) -> Callable:
    """A forward pre-hook for the first block of stage shell ``st``: its first positional
    argument becomes the activation in ``st.slot.value`` (the previous stage's), when there is one."""
    def hook(mod: Any, args: tuple, kwargs: dict) -> tuple | None:
        if st.slot.value is None:
            return None
        if not args:
            raise RuntimeError(f"pipeline: the first block of stage {st.index} got no positional argument to "
                               "take the previous stage's activation")
        return (st.slot.value, *args[1:]), kwargs
    return hook


def capture_hook(st: Any) -> Callable:
    """A forward hook for the last block of stage shell ``st``: keeps the tensor it hands on in ``st.slot.out``."""
    def hook(mod: Any, args: tuple, out: Any) -> None:
        st.slot.out = first_tensor(out)
    return hook


class StepState:
    """What the actions of one step share: the microbatches, losses, saved activations, local
    hand-offs between stages of this rank (and inputs a pair received ahead), and the compute
    time so far."""

    def __init__(self, mb_in: list, mb_tg: list, losses: torch.Tensor, units: StageUnits) -> None:
        self.mb_in, self.mb_tg, self.losses, self.units = mb_in, mb_tg, losses, units
        self.local: dict = {}  # key -> tensor: hand-offs within this rank, inputs a pair took ahead
        self.saved: dict = {}
        self.pending: dict = {}  # (stage, microbatch) -> what I kept for W
        self.x: torch.Tensor | None = None  # the current forward's input, for the error message
        self.current: Action | None = None  # the action (a pair's half) running, for the error message
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


def agree_on_tag(group: Any, device: torch.device) -> int:
    """A random message tag for a new schedule, broadcast from the group's first rank ([Note:
    messages between stages]); also the group's first collective, which NCCL needs before its
    first batched point-to-point call."""
    tag = torch.tensor([int.from_bytes(os.urandom(4), "little") % (2**31 - 1) + 1], dtype=torch.int64)
    tag = tag.to(device)
    dist.broadcast(tag, group=group, group_src=0)
    return int(tag.item())


def device_of(param: Any) -> torch.device:
    if param is None:
        return torch.device("cpu")
    local = param.to_local() if hasattr(param, "to_local") else param
    if local.device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return local.device
