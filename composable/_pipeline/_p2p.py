"""Point-to-point transport between pipeline ranks: one tensor per message, shape sent ahead.

[Note: messages between stages]
Every message is a fixed 12-int64 header, then the payload. Header: ``status`` (0 data, 1
error), dtype code, ndim, sizes. An error header is followed by the length of a UTF-8 text and
the text itself; a rank that receives one re-raises that text, so a failure on one stage ends
every stage's step with the same one-line message instead of leaving them waiting.

Sends are asynchronous and waited for at the end of the step; receives are blocking and, from
each peer, taken in the order that peer sends (no tags: order is what NCCL matches on too).
A send is not issued on its own right away: it waits in an outbox until the start of the next
action, and if that action receives, the sends and the receive go out as one
``batch_isend_irecv`` group. On NCCL the point-to-point operations of a pair of ranks run in
order on one stream, so a lone send followed by a receive, mirrored on the peer (1F1B: rank 0
sends an activation then waits for a gradient while rank 1 sends that gradient then waits for
the activation), would wait on each other forever; grouped, they progress together (as torch's
own schedules do). On gloo the grouping changes nothing. A rank knows every rank's action list, so it knows which message comes next
from each peer; a message that arrives before it is needed waits in a buffer. That adds no
waiting a tag-matched receive would not have: a peer's later message is always produced
after its earlier ones.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

__all__ = ["P2P", "PeerFailed"]

_HEADER = 12
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


class PeerFailed(RuntimeError):
    """Another pipeline rank failed; ``str()`` is its message."""


class P2P:
    """Messages on the ``pp`` process group ``group`` (ranks are group ranks)."""

    def __init__(self, group, device: torch.device) -> None:
        self.group = group
        self.device = device
        self._pending: list = []  # (work, tensor) of sends in flight
        self._outbox: list = []  # (peer, tensor) of sends not issued yet
        self._expected: dict[int, deque] = {}  # peer -> keys still to come, in its send order
        self._buffer: dict[tuple, torch.Tensor] = {}

    def expect(self, peer: int, keys: list) -> None:
        self._expected[peer] = deque(keys)

    def send(self, peer: int, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous()
        if t.dim() > _HEADER - 3:
            raise ValueError(f"pipeline: an activation of {t.dim()} dims cannot be sent (at most {_HEADER - 3})")
        if t.dtype not in _CODE:
            raise ValueError(f"pipeline: activations of dtype {t.dtype} cannot be sent between stages")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[1], header[2] = _CODE[t.dtype], t.dim()
        if t.dim():
            header[3:3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        self._outbox += [(peer, header), (peer, t)]

    def _ops(self) -> list:
        ops = [dist.P2POp(dist.isend, x, group=self.group, group_peer=peer) for peer, x in self._outbox]
        return ops

    def flush(self) -> None:
        """Issue the sends waiting in the outbox."""
        if self._outbox:
            works = dist.batch_isend_irecv(self._ops())
            self._pending += list(zip(works, [x for _, x in self._outbox]))
            self._outbox.clear()

    def _recv_into(self, t: torch.Tensor, peer: int) -> None:
        """Receive ``t`` from ``peer``, issuing the outbox's sends in the same group."""
        ops = self._ops() + [dist.P2POp(dist.irecv, t, group=self.group, group_peer=peer)]
        works = dist.batch_isend_irecv(ops)
        self._pending += list(zip(works[:-1], [x for _, x in self._outbox]))
        self._outbox.clear()
        works[-1].wait()

    def send_error(self, peer: int, text: str) -> None:
        data = torch.tensor(list(text.encode()[:4000]), dtype=torch.uint8, device=self.device)
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0], header[1] = 1, data.numel()
        self._outbox += [(peer, header), (peer, data)]
        self.flush()

    def _recv_one(self, peer: int) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        self._recv_into(header, peer)
        h = header.tolist()
        if h[0] == 1:
            data = torch.empty(h[1], dtype=torch.uint8, device=self.device)
            self._recv_into(data, peer)
            raise PeerFailed(bytes(data.cpu().tolist()).decode(errors="replace"))
        out = torch.empty(h[3:3 + h[2]], dtype=_DTYPES[h[1]], device=self.device)
        self._recv_into(out, peer)
        return out

    def recv(self, peer: int, key: tuple) -> torch.Tensor:
        """The message ``key`` from ``peer``, receiving (and buffering) the ones it sends first."""
        while key not in self._buffer:
            queue = self._expected.get(peer)
            if not queue:
                raise RuntimeError(f"pipeline: internal error, no message {key} expected from pp rank {peer}")
            nxt = queue.popleft()
            self._buffer[nxt] = self._recv_one(peer)
        return self._buffer.pop(key)

    def wait_sends(self) -> None:
        self.flush()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def drop(self) -> None:
        """Forget sends and buffers after a failed step (the peers will not take them)."""
        self._pending.clear()
        self._outbox.clear()
        self._buffer.clear()
