"""Mixture of experts and expert parallelism: the `MoE` layer and the `ExpertParallel` style.

One file per concept:

| file | concept |
| --- | --- |
| `_router.py` | `TopKRouter` (top-k token choice, softmax / sigmoid scores), the load-balancing and z losses |
| `_experts.py` | `GroupedExperts`: stacked SwiGLU expert weights ``[E, ...]``, computed per expert |
| `_layer.py` | `MoE`: router + experts (+ shared experts), capacity factor, the order of the routed rows |
| `_dispatch.py` | the differentiable ``all_to_all_single`` with variable splits, the count exchange |
| `_style.py` | `ExpertParallel`: experts split over the ``ep`` mesh, tokens dispatched and combined |
| `_style_tp.py` | `ExpertTensorParallel`: EP x TP, each expert's own weights column / row split over ``tp`` |
| `_hf.py` | Hugging Face sparse MoE blocks (Mixtral, Qwen2/3-MoE) -> `MoE`, weights kept; the EP plan |
| `_fsdp_ep.py` | `fully_shard_experts`: EP x FSDP, the experts' unit and its gradient divide factor |

Imports only the public names of ``_tp`` (``ParallelStyle``) and of ``_fsdp``. See
docs/expert_parallel.md.
"""

from ._experts import GroupedExperts
from ._fsdp_ep import fully_shard_experts
from ._hf import expert_parallel_plan, moe_from_hf, swap_hf_moe_blocks
from ._layer import MoE, MoEStats, SharedExperts
from ._router import Routing, TopKRouter, load_balancing_loss, router_z_loss, sequence_load_balancing_loss
from ._style import DispatchStats, ExpertParallel
from ._style_tp import ExpertTensorParallel

__all__ = ["MoE", "MoEStats", "SharedExperts", "GroupedExperts", "TopKRouter", "Routing", "load_balancing_loss",
           "sequence_load_balancing_loss", "router_z_loss", "ExpertParallel", "ExpertTensorParallel", "DispatchStats",
           "fully_shard_experts", "moe_from_hf", "swap_hf_moe_blocks", "expert_parallel_plan"]
