"""The torch FSDP2 + DCP tutorial, as a user writes it, for torch's implementation.

`tests/compat/test_dcp_tutorial.py` runs this file twice: as it is, and with the lines between
the two ``# -- imports`` markers replaced by `SHARDWISE_IMPORTS` (nothing else changes). Meta-device
init, ``fully_shard`` per block and the root, ``to_empty`` + init, bf16/fp32 mixed precision,
``clip_grad_norm_``, an ``AppState(Stateful)`` with ``get_state_dict``/``set_state_dict``,
``dcp.save``/``dcp.load`` with ``checkpoint_id=``, ``dcp.async_save(...).result()``.
"""

# -- imports: torch's
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
# -- imports: end

import torch
import torch.distributed as dist

from tests.compat._adapter import TinyLM, batches, dp_slice, loss_of

SHARDWISE_IMPORTS = """\
import shardwise.checkpoint as dcp
from shardwise.checkpoint import get_state_dict, set_state_dict
from shardwise.checkpoint import Stateful
from shardwise.composable import MixedPrecisionPolicy, fully_shard
"""


class AppState(Stateful):
    """The tutorial's wrapper: DCP calls state_dict() on save and load_state_dict() on load."""

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def build(seed):
    with torch.device("meta"):
        model = TinyLM()
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def train(model, optimizer, data):
    losses = []
    rank, world = dist.get_rank(), dist.get_world_size()
    for tokens in data:
        loss = loss_of(model, dp_slice(tokens, rank, world))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def full(model):
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def main(ckpt_dir, save_at=2, more=2):
    """Train, save (sync) at ``save_at``, train ``more``, async-save; then resume both
    checkpoints into fresh models. Returns the losses and what the resumed runs saw."""
    data = batches(save_at + 2 * more)
    model, optimizer = build(seed=0)
    losses = train(model, optimizer, data[:save_at])
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=f"{ckpt_dir}/step-{save_at}")
    losses += train(model, optimizer, data[save_at:save_at + more])
    future = dcp.async_save({"app": AppState(model, optimizer)}, checkpoint_id=f"{ckpt_dir}/step-{save_at + more}")
    future.result()
    at_async = full(model)
    losses += train(model, optimizer, data[save_at + more:])

    model2, optimizer2 = build(seed=7)  # another init: everything must come from the checkpoint
    dcp.load({"app": AppState(model2, optimizer2)}, checkpoint_id=f"{ckpt_dir}/step-{save_at}")
    resumed = train(model2, optimizer2, data[save_at:])

    model3, optimizer3 = build(seed=8)
    dcp.load({"app": AppState(model3, optimizer3)}, checkpoint_id=f"{ckpt_dir}/step-{save_at + more}")
    loaded_async = full(model3)
    resumed_async = train(model3, optimizer3, data[save_at + more:])
    same_params = all(torch.equal(loaded_async[k], at_async[k]) for k in at_async)
    return {"losses": losses, "resumed": resumed, "resumed_async": resumed_async, "async_params_equal": same_params}
