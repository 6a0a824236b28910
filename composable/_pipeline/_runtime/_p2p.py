"""Point-to-point transport between pipeline ranks: one message per tensor once its shape is known.

[Note: messages between stages]
Messages go on *channels*: (peer, kind, stage) with kind ``"act"`` or ``"grad"``. Both ends of a
channel remember the shape and dtype of the last tensor sent on it (the sender when it sends,
the receiver when it receives, in the same order), so both know the size of the next message:
a 12-int64 header (96 bytes) followed by room for one tensor of the remembered shape (just the
header on a channel's first message). Header: ``status``, dtype code, ndim, sizes.

* status 0 (steady state: every microbatch of a step has the same shape, and usually every
  step): the tensor follows the header **in the same message**; one message per transfer.
* status 2 (first message on a channel, or a new shape): the header carries the new shape and
  dtype; the tensor follows as a second message. Shapes may change between steps or microbatches;
  that only costs the second message.
* status 1 (error): ``sizes[0]`` is the length of a UTF-8 text, inline after the header if it fits
  in the message, else in a second message. A rank that receives one re-raises the text, so a
  failure on one stage ends every stage's step with the same one-line message instead of leaving
  them waiting. The failing rank knows which channel each peer will read next from it (its own
  send order, `expect`), so the error message has exactly the size that peer is waiting for.

The sizes of the two ends always agree, which NCCL and gloo need. The cost of one message instead
of two is one copy of the tensor behind the header on the sending side; the receiver's tensor is a
view of the message.

Sends are asynchronous and waited for at the end of the step; receives are blocking and, from
each peer, taken in the order that peer sends (order is what NCCL matches on). Every message of
a schedule carries its tag, a random number the schedule's ranks agree on when it is built: a
step that failed can leave messages unreceived (a send already on its way, an error sent to a
peer that had already stopped), and a later `PipelineSchedule` on the same group — on the same
split or another one — must not take them. gloo matches tags, so it never sees them; NCCL
ignores tags (after a failure there, restart the job).
A send is not issued on its own right away: it waits in an outbox until the start of the next
action, and if that action receives, the sends and the receive go out as one
``batch_isend_irecv`` group. On NCCL the point-to-point operations of a pair of ranks run in
order on one stream, so a lone send followed by a receive, mirrored on the peer (1F1B: rank 0
sends an activation then waits for a gradient while rank 1 sends that gradient then waits for
the activation), would wait on each other forever; grouped, they progress together (as torch's
own schedules do). On gloo the grouping changes nothing. A rank knows every rank's action list,
so it knows which message comes next from each peer; a message that arrives before it is needed
waits in a buffer. That adds no waiting a tag-matched receive would not have: a peer's later
message is always produced after its earlier ones.

[Note: receiving ahead]
On gloo (CPU tensors) a receive posted only when its action starts leaves the transfer to
happen then, when the sender may be computing and its communication thread waiting for a core.
So as soon as a message from a peer has arrived, the receive of the next one from that peer is
posted (its size is known: the channel's remembered shape, or a header), and the data can move
while the receiver still computes, often while the sender waits for its own next message
(measured: docs/benchmarks.md#pipeline, ``benchmarks/pipeline.py --parts ahead``). Off on
NCCL: a posted receive occupies the pair's ordered stream there, and a send queued behind it
could wait for a message that needs that send first. A receive posted ahead in a step that
fails may never complete; messages are tagged per schedule (above), so it cannot take a later
schedule's message.

[Note: after a failed step]
A failed step leaves transfers in flight: a receive posted ahead whose message the peer sends
(or has sent) anyway, sends whose receiver stopped before taking them. Their buffers must stay
alive until gloo is done with them, even though nobody will read them. gloo matches a message
to a posted receive, or a peer's "ready to receive" to a queued send, when it arrives; if the
buffer behind it has been freed by then, gloo does not drop the message: it stops reading
(or writing) that connection for good, and every later message between the two ranks, of any
schedule or collective, waits forever (`test_transfers_left_by_a_failed_step_stay_alive`
makes the other end show up after the drop, both ways round). So `drop` does not forget them: it
moves them to ``in_flight``, a list that the split owns (``PipelineSplit.in_flight``) and a
new schedule on the split shares, where they complete whenever their message comes, or stay.
Cost: the few buffers of the transfers left open by each failure, for as long as the split.

[Note: sends held back]
A pair's halves ([Note: forward/backward pairs] in ``_pipeline_schedule.py``) may run in either order, but
each peer expects our messages in one static order (it receives ahead by size, in that order):
the order of our action list, a pair's forward before its backward. So a message that is ready
before an earlier one to the same peer (a pair's backward output, when its backward ran first)
is held (`send` keeps it) and goes out right after the earlier one; a message to another peer
is not delayed. `wait_sends` checks that nothing is left held at the end of a step.
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
        """Whether taking ``key`` from ``peer`` would not wait: it is buffered, or it and every
        message before it have arrived in receives posted ahead ([Note: receiving ahead]), which
        this takes into the buffer. False for a message not taken yet where nothing is posted
        ahead (NCCL)."""
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
