"""A state dict read from another thread during forward or backward changes nothing the step sees.

torchft reads ``model.state_dict()`` from its quorum thread while the training thread is in its
forward; torch's FSDP2 reshards the running unit there and the forward fails ("mixed
torch.Tensor and DTensor"). Here the reader gets the sharded parameters and the step goes on
([Note: a state dict read from another thread] in ``composable/_fsdp/_fully_shard.py``): on 2
ranks, a reader thread is run to completion inside the forward (a forward pre-hook of a middle
layer, the root and the first layer unsharded) and inside the backward (a gradient hook), and
another reads in a loop the whole time; the losses equal those of training without a reader, and
every value read is a whole shard of its parameter.
"""

from __future__ import annotations

import threading

import torch
import torch.nn as nn

from tests._dist import run_on_workers

STEPS, DIM = 4, 16


def _train(rank: int, world: int, readers: bool) -> dict:
    from torch.distributed.tensor import DTensor

    from shardwise.composable import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM), nn.Linear(DIM, 4))
    for m in (model[0], model[2], model[3], model):
        fully_shard(m)
    shapes = {k: v.to_local().shape for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bad: list[str] = []
    reads = [0]

    def read() -> None:
        for k, v in model.state_dict().items():
            if not isinstance(v, DTensor) or v.to_local().shape != shapes[k]:
                bad.append(f"{k}: {type(v).__name__} {tuple(v.shape)}")
        reads[0] += 1

    def read_in_thread(*_: object) -> None:
        t = threading.Thread(target=read)
        t.start()
        t.join()

    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            read()

    if readers:
        model[2].register_forward_pre_hook(read_in_thread)
        looping = threading.Thread(target=loop)
        looping.start()
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * step + rank)
        out = model(torch.randn(8, DIM, generator=g))
        if readers:
            out.register_hook(lambda grad: read_in_thread())
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if readers:
        stop.set()
        looping.join()
    return {"losses": losses, "bad": bad, "reads": reads[0]}


def test_state_dict_read_from_another_thread_mid_step_changes_nothing():
    plain = run_on_workers(_train, 2, False, timeout=120)
    read = run_on_workers(_train, 2, True, timeout=120)
    for rank in range(2):
        assert read[rank]["bad"] == [], f"rank {rank}: values read that are not whole shards: {read[rank]['bad'][:5]}"
        assert read[rank]["reads"] >= 2 * STEPS, f"rank {rank}: only {read[rank]['reads']} reads"
        assert read[rank]["losses"] == plain[rank]["losses"], (rank, read[rank]["losses"], plain[rank]["losses"])
