"""The private torch APIs the pipeline needs (house rule: private APIs only in compat modules).

A tensor held by another stage ([Note: checkpoints of a split model] in ``_checkpoint.py``) is a
DTensor on a ``DeviceMesh`` built with ``_init_backend=False``: it names that stage's ranks with
no process groups, and this rank's coordinate on it is None. `weight_grads_of` reads what autograd
nodes saved ([Note: weight gradients from saved tensors]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["bind_weight_grads", "mesh_without_groups", "run_backward", "weight_grads_of"]


def mesh_without_groups(device_type: str, ranks: list, names: tuple[str, ...] | None) -> DeviceMesh:
    """A DeviceMesh over the global ``ranks`` (nested list) with no process groups."""
    return DeviceMesh(device_type, torch.tensor(ranks, dtype=torch.int64), mesh_dim_names=names,
                      _init_backend=False)


# [Note: weight gradients from saved tensors]
# ``W`` of a split backward runs each frontier source ``N`` once more for the outputs ``I``
# skipped ([Note: split backward] in ``_split_backward.py``). Through the autograd engine that
# is one engine call per source, and each call first walks the whole graph below ``N``
# (measured: 50 to 560 us per call on a 4-block Llama stage, 7 ms for its 38 sources, against
# about 4 ms for all its weight-gradient matmuls). For the node types of linear layers and norm
# gains the outputs ``I`` skipped are one expression of the gradient ``N`` received and what
# ``N`` saved in the forward (its ``_saved_*`` attributes, private); `weight_grads_of` computes
# them with the expression autograd's own formula uses (torch's ``mm_mat2_backward`` and
# ``mul_tensor_backward``: the same ops on the same operands in the same layouts, so the same
# bits), reduced to the edge's shape and dtype checked as the engine does on a node's outputs.
# Anything else returns None and ``W`` uses the engine. `bind_weight_grads` checks all this
# when ``I`` ends and returns a function holding just the gradient and the operands (so ``I`` can
# let the graph go: [Note: what I keeps for W]); an operand saved behind an unpack hook
# (``_raw_saved_*.unpack_hook``, private) is left to be read by ``W``. tests/test_pipeline_split_fast.py
# compares every case bit for bit with a full backward. (On this CPU build both operand orders of
# the mm give the same bits; the rule is kept for backends where they differ.) Reading a saved
# tensor of a non-reentrant activation checkpoint outside a backward recomputes its region, as
# each engine call of the fallback does: one read per node, the input, so no more than before.

def _mm_mat2_grad(grad: torch.Tensor, mat1: torch.Tensor, sizes: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    # mat2 column-major (a linear's ``weight.t()``): the gradient in that order, as autograd does
    if strides[0] == 1 and strides[1] == sizes[0]:
        return grad.t().mm(mat1).t()
    return mat1.t().mm(grad)


def _dense(*ts: torch.Tensor) -> bool:
    return all(t.layout == torch.strided and not t.is_complex() for t in ts)


def _hooked(node: Any, name: str) -> bool:
    """Whether the tensor ``node`` saved as ``name`` comes back through an unpack hook (an
    activation checkpoint's, an offload's): reading it then recomputes or copies it."""
    return getattr(node, f"_raw_saved_{name}").unpack_hook is not None


def _run(g: torch.Tensor, steps: list) -> list:
    out = []
    for op, operand, sizes, strides, shape in steps:
        if op == "mm":
            out.append(_mm_mat2_grad(g, operand, sizes, strides))
            continue
        v = g if operand is None else g * operand
        out.append(v if v.shape == shape else v.sum_to_size(shape))
    return out


def bind_weight_grads(node: Any, grad_outputs: tuple, slots: list[tuple[int, ...]], edges: list, *,
                      unhooked: bool = False) -> Callable[[], list] | None:
    """A function of no arguments that returns the gradients ``node`` sends along ``edges`` (fed
    by its outputs ``slots[k]``), given the ``grad_outputs`` it received, for known node types;
    None where the engine must run it. It holds the gradient and the saved operands it reads, not
    ``node``. ``unhooked``: None also where an operand is saved behind an unpack hook (so that it is
    read only when the function's result is needed). See [Note: weight gradients from saved tensors]."""
    name = type(node).__name__
    if len(grad_outputs) != 1 or not isinstance(grad_outputs[0], torch.Tensor) or any(len(s) != 1 for s in slots):
        return None
    g = grad_outputs[0]
    steps: list = []
    for (slot,), edge in zip(slots, edges):
        if name == "MmBackward0" and slot == 1:
            if unhooked and _hooked(node, "self"):
                return None
            # mm's operands share dtype and device; the result has mat2's sizes: the edge's metadata
            mat1, strides = node._saved_self, node._saved_mat2_sym_strides
            if not _dense(g, mat1) or len(strides) != 2:  # a strided mat2 (a sparse one has no strides)
                return None
            steps.append(("mm", mat1, node._saved_mat2_sym_sizes, strides, None))
            continue
        if name == "AddmmBackward0" and slot in (0, 2):
            if node._saved_alpha != 1 or node._saved_beta != 1:
                return None
            if slot == 2:
                if unhooked and _hooked(node, "mat1"):
                    return None
                mat1, strides = node._saved_mat1, node._saved_mat2_sym_strides
                if not _dense(g, mat1) or len(strides) != 2:
                    return None
                steps.append(("mm", mat1, node._saved_mat2_sym_sizes, strides, None))
                continue
            factor, dtype = None, g.dtype  # the bias: broadcast in the forward, reduced in `_run`
        elif name == "MulBackward0" and slot in (0, 1):
            if unhooked and _hooked(node, "other" if slot == 0 else "self"):
                return None
            factor = node._saved_other if slot == 0 else node._saved_self
            if not _dense(g, factor):
                return None
            dtype = torch.result_type(g, factor)
        else:
            return None
        meta = edge.node._input_metadata[edge.output_nr]  # the engine's checks on a node's output
        if dtype != meta.dtype or g.device != meta.device:
            return None
        steps.append(("mul", factor, None, None, meta.shape))
    return partial(_run, g, steps)


def weight_grads_of(node: Any, grad_outputs: tuple, slots: list[tuple[int, ...]], edges: list) -> list | None:
    """The gradients ``node`` sends along ``edges`` now (`bind_weight_grads`, called), or None
    where the engine must run it."""
    fn = bind_weight_grads(node, grad_outputs, slots, edges)
    return None if fn is None else fn()


def run_backward(edges: list, values: list) -> None:
    """``torch.autograd.backward(edges, values)`` without its per-root Python checks: `weight_grads_of`
    already gave each value its edge's shape, dtype and device (measured: the checks cost 1.3 ms
    per ``W`` of a 4-block Llama stage, 38 roots)."""
    torch.autograd.graph._engine_run_backward(tuple(edges), tuple(values), False, False, (),
                                              allow_unreachable=True, accumulate_grad=True)
