"""What each part of a model costs, for balancing: measured time, parameter bytes, activation bytes.

[Note: measuring block costs]
One instrumented forward + backward of the unsplit model on a sample batch gives every part's
cost: forward hooks time each block, ``pre`` is what runs before the first block, ``post`` what
runs after the last (loss included). In backward a hook on each block's input fires when that
block's backward is done, so block ``i``'s time is the gap between the hooks of blocks ``i + 1``
and ``i``. On CUDA each hook synchronizes and reads the wall clock; on CPU the clock is process
CPU time (less disturbed by load). One warm-up, then the median of ``repeats`` passes. Activation
bytes are what autograd saves (``saved_tensors_hooks``), parameters excluded.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["COST_KINDS", "Costs", "average_costs", "measure_costs", "param_costs"]

Costs = tuple[float, list[float], float]
"""``(pre, per block, post)``."""

COST_KINDS = ("time", "params", "activations")


def _bytes(module: nn.Module) -> float:
    return float(sum(p.numel() * p.element_size() for p in module.parameters()))


def param_costs(blocks: Sequence[nn.Module], pre: Sequence[nn.Module], post: Sequence[nn.Module]) -> Costs:
    """``(pre, per block, post)`` parameter bytes."""
    return sum(map(_bytes, pre)), [_bytes(b) for b in blocks], sum(map(_bytes, post))


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def _one_pass(model: nn.Module, blocks: Sequence[nn.Module], run: Callable[[], torch.Tensor], kind: str,
              sync: Callable[[], None], clock: Callable[[], float]) -> Costs:
    n = len(blocks)
    region: list[str | int] = ["pre"]
    act: dict[str | int, float] = {"pre": 0.0, "post": 0.0, **{i: 0.0 for i in range(n)}}
    f_start, f_end = [0.0] * n, [0.0] * n
    g_in: list[float | None] = [None] * n
    g_out: list[float | None] = [None]
    param_ptrs = {p.data_ptr() for p in model.parameters()}
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def now() -> float:
        sync()
        return clock()

    for i, b in enumerate(blocks):
        def pre_hook(mod: nn.Module, args: tuple, i: int = i) -> None:
            f_start[i] = now()
            region[0] = i
            x = _first_tensor(args)
            if x is not None and x.requires_grad:
                x.register_hook(lambda g, i=i: g_in.__setitem__(i, now()))

        def post_hook(mod: nn.Module, args: tuple, out: Any, i: int = i) -> None:
            f_end[i] = now()
            region[0] = "post" if i == n - 1 else "between"
            y = _first_tensor(out)
            if i == n - 1 and y is not None and y.requires_grad:
                y.register_hook(lambda g: g_out.__setitem__(0, now()))

        handles.append(b.register_forward_pre_hook(pre_hook))
        handles.append(b.register_forward_hook(post_hook))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if region[0] != "between" and t.data_ptr() not in param_ptrs:
            act[region[0]] += t.numel() * t.element_size()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            t0 = now()
            loss = run()
            t1 = now()
        loss.backward()
        t2 = now()
    finally:
        for h in handles:
            h.remove()
    if kind == "activations":
        return act["pre"], [act[i] for i in range(n)], act["post"]
    g_at, g_end = [g for g in g_in if g is not None], g_out[0]
    if len(g_at) < n or g_end is None:
        raise ValueError("pipeline: cost='time' could not time every block's backward (a block input or output "
                         "needs no grad); use cost='params' or pass split_points=")
    bwd = [g_at[i] - (g_end if i == n - 1 else g_at[i + 1]) for i in range(n)]
    fwd = [f_end[i] - f_start[i] for i in range(n)]
    pre = (f_start[0] - t0) + (t2 - g_at[0])
    post = (t1 - f_end[-1]) + (g_end - t1)
    return pre, [f + b for f, b in zip(fwd, bwd)], post


def measure_costs(model: nn.Module, blocks: Sequence[nn.Module], run: Callable[[], torch.Tensor], kind: str,
                  repeats: int = 3, average: bool = True) -> Costs:
    """``(pre, per block, post)`` measured on ``run()`` ([Note: measuring block costs]); with
    ``average``, averaged over the default group (`average_costs`) so every rank plans alike."""
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    clock = time.perf_counter if dev.type == "cuda" else time.process_time
    passes = 1 if kind == "activations" else repeats
    if kind == "time":
        _one_pass(model, blocks, run, kind, sync, clock)  # warm-up
    results = [_one_pass(model, blocks, run, kind, sync, clock) for _ in range(passes)]
    model.zero_grad(set_to_none=True)
    pre = statistics.median(r[0] for r in results)
    post = statistics.median(r[2] for r in results)
    per = [statistics.median(r[1][i] for r in results) for i in range(len(blocks))]
    return average_costs((pre, per, post)) if average else (pre, per, post)


def average_costs(costs: Costs) -> Costs:
    """``(pre, per block, post)`` averaged over the default group (one all-reduce; unchanged
    without a group). Every rank must pass as many blocks: agree on the model first
    ([Note: agreeing before the first collective] in ``_agree.py``)."""
    pre, per, post = costs
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        where = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([pre, post, *per], dtype=torch.float64, device=where)
        dist.all_reduce(t)
        t /= dist.get_world_size()
        vals = t.tolist()
        pre, post, per = vals[0], vals[1], vals[2:]
    return pre, list(per), post
