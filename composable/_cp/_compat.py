"""The torch private API of context-parallel attention: the fused CPU flash-attention kernel and
its backward, which return and take the log-sum-exp (public SDPA does not). Tested in
``tests/test_cp_attention.py::test_fused_kernel_is_what_the_blocks_rely_on``. Relied on:

* ``aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=s)`` returns
  ``(out, lse)`` for equal head counts: ``lse [B, H, Tq]`` float32, of ``s * q k^T`` (top-left
  causal mask with ``is_causal``);
* its ``_backward(do, q, k, v, out, lse, 0.0, is_causal, scale=s)`` returns ``(dq, dk, dv)`` from
  the ``out`` and ``lse`` given, so the *final* row's output and lse give one block's share.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fused_available", "fused_forward", "fused_backward"]

_FWD: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BWD: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_available(q: torch.Tensor) -> bool:
    """Whether the fused kernel serves ``q`` (a CPU tensor of a dtype it takes)."""
    return _FWD is not None and _BWD is not None and q.device.type == "cpu" and q.dtype in _DTYPES


def fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _FWD(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def fused_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _BWD(do, q, k, v, out, lse, 0.0, causal, scale=scale)
    return dq, dk, dv
