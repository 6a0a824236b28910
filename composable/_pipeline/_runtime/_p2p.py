"""Point-to-point transport between pipeline ranks: one message per tensor once its shape is known.

[Note: messages between stages]
Messages go on *channels* (peer, ``"act"`` or ``"grad"``, stage). Both ends remember the shape and
dtype of the channel's last tensor, so both know the next message's size: a 12-int64 header
(`_wire.py`) plus room for one tensor of that shape. Status 0 (steady state): the tensor follows
in the same message. Status 2 (a channel's first message, or a new shape): the header carries the
shape, the tensor comes as a second message. Status 1 (error): ``sizes[0]`` is the length of a
UTF-8 text, inline if it fits, else in a second message; the receiver re-raises it, so every
stage ends the step with the same one-line error. The failing rank knows which channel each peer
reads next from it (`expect`), so the error has exactly the size that peer waits for. Both ends'
sizes always agree (NCCL and gloo need it); the cost is one copy of the tensor behind the header.

Sends are asynchronous and waited for at the end of the step; receives block and follow each
peer's send order (known from its action list; an early message waits in a buffer). Every
message carries the schedule's tag (agreed when it is built), so a later `PipelineSchedule` on
the group never takes a message a failed step left behind (gloo matches tags; on NCCL restart
the job). A send waits in an outbox until the next action starts; if that action receives, the
sends and the receive go out as one ``batch_isend_irecv`` group: on NCCL a lone send then a
receive, mirrored on the peer (1F1B), would wait on each other forever.

[Note: receiving ahead]
On gloo, once a message from a peer has arrived, the receive of its next one is posted (its size
is known), so the data moves while this rank still computes (docs/benchmarks.md#pipeline,
``benchmarks/pipeline.py --parts ahead``). Off on NCCL, where a posted receive holds the pair's
ordered stream and a send queued behind it could deadlock.

[Note: after a failed step]
A failed step leaves transfers in flight (a receive posted ahead, sends nobody takes). If gloo
finds a buffer freed when the message or the peer's "ready" arrives, it stops that connection for
good and every later message between the two ranks hangs
(`test_transfers_left_by_a_failed_step_stay_alive`). So `drop` moves them to ``in_flight``, a list
the split owns (``PipelineSplit.in_flight``) and every schedule on it shares, where they complete
whenever their message comes.

[Note: sends held back]
A pair's halves ([Note: forward/backward pairs] in ``_pipeline_schedule.py``) may run in either
order, but each peer receives our messages in our action list's order (a pair's forward first). A
message ready before an earlier one to the same peer is held (`send` keeps it) and goes out right
after that one; `wait_sends` checks nothing is held at the end of a step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._arrival import Watchers
from ._wire import CODE, DATA, DTYPES, ERROR, HEADER_BYTES, NEW_SHAPE, check_sendable, header, nbytes

__all__ = ["P2P", "PeerFailed"]

class PeerFailed(RuntimeError):
    """Another pipeline rank failed; ``str()`` is its message."""


class P2P:
    """Messages on the ``pp`` process group ``group`` (ranks are group ranks)."""

    def __init__(self, group: Any, device: torch.device, tag: int = 0, in_flight: list | None = None) -> None:
        self.group = group
        self.in_flight = [] if in_flight is None else in_flight  # see [Note: after a failed step]
        self.tag = tag
        self.device = device
        self._pending: list = []  # (work, tensor) of sends in flight
        self._outbox: list = []  # (peer, tensor) of sends not issued yet
        self._expected: dict[int, deque] = {}  # peer -> keys still to come, in its send order
        self._to_send: dict[int, deque] = {}  # peer -> keys we still send it this step, in order
        self._buffer: dict[tuple, torch.Tensor] = {}
        self._sent: dict[tuple, tuple] = {}  # channel -> (dtype, shape, header bytes) last sent
        self._received: dict[tuple, tuple] = {}  # channel -> (dtype, shape) last received
        # receiving ahead: see [Note: receiving ahead]; gloo only (CPU tensors)
        self.ahead = device.type == "cpu"
        self._posted: dict[int, tuple] = {}  # peer -> (key, buffer, work) of the receive posted ahead
        self._held: dict[int, dict[tuple, torch.Tensor]] = {}  # peer -> key -> tensor: [Note: sends held back]
        self._watchers = Watchers()  # threads waiting on receives posted ahead, for `wait_first`
        self.send_s = 0.0  # seconds spent issuing sends (gloo writes what the socket takes there and then)
        self.wait_s = 0.0  # seconds spent waiting for messages to arrive

    def expect(self, peer: int, keys: list, sends: Sequence = ()) -> None:
        """``keys``: what ``peer`` sends us this step, in its order; ``sends``: what we send it."""
        self._expected[peer] = deque(keys)
        self._to_send[peer] = deque(sends)
        self._post_ahead(peer)

    def _post_ahead(self, peer: int) -> None:
        """Post the receive of the next message ``peer`` sends us, if its size is known."""
        queue = self._expected.get(peer)
        if not self.ahead or peer in self._posted or not queue:
            return
        key = queue[0]
        buf = torch.empty(HEADER_BYTES + nbytes(self._received.get((peer, key[0], key[1]))), dtype=torch.uint8,
                          device=self.device)
        self._posted[peer] = (key, buf, dist.irecv(buf, group=self.group, tag=self.tag, group_src=peer))

    def _message(self, peer: int, key: tuple, header: torch.Tensor) -> torch.Tensor:
        """A zeroed message of the size ``peer`` expects next on ``key``'s channel, ``header`` in front."""
        known = self._sent.get((peer, key[0], key[1]))
        size = HEADER_BYTES + (nbytes(known[:2]) if known else 0)
        buf = torch.zeros(size, dtype=torch.uint8, device=self.device)
        buf[:HEADER_BYTES].copy_(header)
        return buf

    def send(self, peer: int, key: tuple, tensor: torch.Tensor) -> None:
        t = check_sendable(tensor.detach().contiguous())
        queue = self._to_send.get(peer)
        if queue and queue[0] != key and key in queue:  # [Note: sends held back]
            self._held.setdefault(peer, {})[key] = t
            return
        if not queue or queue[0] != key:
            raise RuntimeError(f"pipeline: internal error, message {key} to pp rank {peer} is out of order")
        self._send_now(peer, key, t, queue)
        held = self._held.get(peer)
        while held and queue and queue[0] in held:
            nxt = queue[0]
            self._send_now(peer, nxt, held.pop(nxt), queue)

    def _send_now(self, peer: int, key: tuple, t: torch.Tensor, queue: deque) -> None:
        channel, shape = (peer, key[0], key[1]), tuple(t.shape)
        known = self._sent.get(channel)
        if known is not None and known[0] == t.dtype and known[1] == shape:
            buf = torch.empty(HEADER_BYTES + t.numel() * t.element_size(), dtype=torch.uint8, device=self.device)
            buf[:HEADER_BYTES].copy_(known[2])
            buf[HEADER_BYTES:].view(t.dtype).view(shape).copy_(t)
            self._outbox.append((peer, buf))
        else:
            head = header(NEW_SHAPE, CODE[t.dtype], shape)
            self._outbox += [(peer, self._message(peer, key, head)), (peer, t)]
            self._sent[channel] = (t.dtype, shape, header(DATA, CODE[t.dtype], shape).to(self.device))
        queue.popleft()

    def _ops(self) -> list:
        ops = [dist.P2POp(dist.isend, x, group=self.group, tag=self.tag, group_peer=peer) for peer, x in self._outbox]
        return ops

    def flush(self) -> None:
        """Issue the sends waiting in the outbox (the time it takes adds to ``send_s``)."""
        if self._outbox:
            t0 = time.perf_counter()
            works = dist.batch_isend_irecv(self._ops())
            self._pending += list(zip(works, [x for _, x in self._outbox]))
            self._outbox.clear()
            self.send_s += time.perf_counter() - t0

    def _recv_into(self, t: torch.Tensor, peer: int) -> None:
        """Receive ``t`` from ``peer``, issuing the outbox's sends in the same group."""
        ops = self._ops() + [dist.P2POp(dist.irecv, t, group=self.group, tag=self.tag, group_peer=peer)]
        t0 = time.perf_counter()
        works = dist.batch_isend_irecv(ops)
        if len(ops) > 1:
            self.send_s += time.perf_counter() - t0
        self._pending += list(zip(works[:-1], [x for _, x in self._outbox]))
        self._outbox.clear()
        t0 = time.perf_counter()
        works[-1].wait()
        self.wait_s += time.perf_counter() - t0

    def send_error(self, peer: int, text: str) -> None:
        """Send ``text`` as an error to ``peer``, sized as the message it waits for from us next."""
        data = torch.tensor(list(text.encode()[:4000]), dtype=torch.uint8, device=self.device)
        queue = self._to_send.get(peer)
        key = queue[0] if queue else ("error", -1)
        buf = self._message(peer, key, header(ERROR, 0, [data.numel()]))
        if data.numel() <= buf.numel() - HEADER_BYTES:
            buf[HEADER_BYTES:HEADER_BYTES + data.numel()].copy_(data)
            self._outbox.append((peer, buf))
        else:
            self._outbox += [(peer, buf), (peer, data)]
        self.flush()

    def _recv_one(self, peer: int, key: tuple) -> torch.Tensor:
        channel = (peer, key[0], key[1])
        known = self._received.get(channel)
        posted = self._posted.get(peer)
        if posted is not None:
            if posted[0] != key:
                raise RuntimeError(f"pipeline: internal error, the receive posted ahead from pp rank {peer} is for "
                                   f"{posted[0]}, not {key}")
            buf = posted[1]
            self.flush()
            t0 = time.perf_counter()
            if not self._watchers.take(peer, posted[2]):  # a watcher thread waited (or raised) for us
                posted[2].wait()
            self.wait_s += time.perf_counter() - t0
            del self._posted[peer]  # only now: if anything above raised, `drop` keeps it in flight
        else:
            buf = torch.empty(HEADER_BYTES + nbytes(known), dtype=torch.uint8, device=self.device)
            self._recv_into(buf, peer)
        h = buf[:HEADER_BYTES].view(torch.int64).tolist()
        if h[0] == ERROR:
            n = h[3]
            if n <= buf.numel() - HEADER_BYTES:
                data = buf[HEADER_BYTES:HEADER_BYTES + n]
            else:
                data = torch.empty(n, dtype=torch.uint8, device=self.device)
                self._recv_into(data, peer)
            raise PeerFailed(bytes(data.cpu().tolist()).decode(errors="replace"))
        dtype, shape = DTYPES[h[1]], tuple(h[3:3 + h[2]])
        if h[0] == DATA:
            if known != (dtype, shape):
                raise RuntimeError(f"pipeline: internal error, message {key} from pp rank {peer} has shape "
                                   f"{shape} and dtype {dtype}, expected {known}")
            return buf[HEADER_BYTES:].view(dtype).view(shape)
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self._recv_into(out, peer)
        self._received[channel] = (dtype, shape)
        return out

    def _take_next(self, peer: int) -> None:
        """Receive the next message ``peer`` sends us into the buffer."""
        queue = self._expected.get(peer)
        if not queue:
            raise RuntimeError(f"pipeline: internal error, no more messages expected from pp rank {peer}")
        nxt = queue.popleft()
        self._buffer[nxt] = self._recv_one(peer, nxt)
        self._post_ahead(peer)

    def arrived(self, peer: int, key: tuple) -> bool:
        """Whether taking ``key`` from ``peer`` would not wait (it and every message before it
        have arrived in receives posted ahead, which this buffers); False with nothing posted."""
        while key not in self._buffer:
            posted = self._posted.get(peer)
            if posted is None or not (posted[2].is_completed() or self._watchers.done(peer, posted[2])):
                return False
            self._take_next(peer)
        return True

    def wait_first(self, wants: Sequence[tuple[int, tuple]]) -> int:
        """The index in ``wants`` (``(peer, key)``s, each from its own peer, with receives posted
        ahead) of the first message to arrive ([Note: waiting for the first arrival] in ``_arrival.py``)."""
        while True:
            self._watchers.wake.clear()
            for n, (peer, key) in enumerate(wants):
                if self.arrived(peer, key):
                    return n
            for peer, _ in wants:
                posted = self._posted.get(peer)
                if posted is None:
                    raise RuntimeError(f"pipeline: internal error, nothing posted ahead from pp rank {peer}")
                self._watchers.watch(peer, posted[2])
            t0 = time.perf_counter()
            self._watchers.wake.wait()
            self.wait_s += time.perf_counter() - t0

    def sent_before(self, peer: int, a: tuple, b: tuple) -> bool:
        """Whether ``peer`` sends us ``a`` before ``b`` (each still to come or buffered)."""
        if a in self._buffer or b in self._buffer:
            return a in self._buffer
        queue = list(self._expected.get(peer, ()))
        return a in queue and (b not in queue or queue.index(a) < queue.index(b))

    def recv(self, peer: int, key: tuple) -> torch.Tensor:
        """The message ``key`` from ``peer``, receiving (and buffering) the ones it sends first."""
        while key not in self._buffer:
            if not self._expected.get(peer):
                raise RuntimeError(f"pipeline: internal error, no message {key} expected from pp rank {peer}")
            self._take_next(peer)
        return self._buffer.pop(key)

    def wait_sends(self) -> None:
        if any(self._held.values()):
            raise RuntimeError(f"pipeline: internal error, sends held back at the end of the step: {self._held}")
        self.flush()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def drop(self) -> None:
        """After a failed step: forget buffered messages and channel shapes; the transfers still
        in flight go to ``in_flight`` with their buffers ([Note: after a failed step])."""
        self.in_flight += self._pending
        self.in_flight += [(work, buf) for _, buf, work in self._posted.values()]
        self._pending.clear()
        self._outbox.clear()
        self._posted.clear()
        self._watchers.clear()
        self._held.clear()
        self._buffer.clear()
        self._sent.clear()
        self._received.clear()
