"""`AllocationTracker`: peak bytes of live tensor storages, from tensor operations, not RSS.

    tracker = AllocationTracker()
    tracker.track(model.parameters(), "params")   # tensors that exist before tracking starts
    with tracker:
        loss_fn(model(x)).backward()
    tracker.peak, tracker.peak_by_tag

Every tensor that goes into or comes out of an operation run under the tracker (a
``TorchDispatchMode``) has its storage recorded, once, through a weak reference: a storage
stops counting when it dies. After every operation the tracker sums the *current* size of
every live storage, so storages resized in place (``untyped_storage().resize_(0)`` to free
an unsharded parameter, ``resize_(n)`` to refill it, as ``fully_shard`` does) count at their
size of the moment. Tensor subclasses (DTensor) are unwrapped to their inner tensors.

Counted: the tensors' storages. Not counted: a kernel's internal scratch memory, the
allocator's caching and fragmentation, non-tensor memory (Python objects, communication
library buffers). Sizes are exact between operations; a storage freed without any operation
after it is seen at the next operation.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["AllocationTracker"]


def _plain_tensors(t: torch.Tensor):
    """``t`` itself, or the inner tensors of a traceable subclass such as DTensor (recursively)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not hasattr(t, "__tensor_flatten__"):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            yield from _plain_tensors(inner)


class AllocationTracker(TorchDispatchMode):
    """Peak bytes of the live storages of tracked tensors (see the module docstring).

    Attributes (read after or during tracking):
        peak: the largest total seen, in bytes.
        peak_phase: the value of ``phase`` when the peak was reached.
        peak_by_tag: bytes per tag at the peak (``"new"`` for storages first seen in an op).
        phase: a label the caller sets ("forward", "backward", ...) to locate the peak.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[weakref.ref, str]] = {}
        self.peak = 0
        self.peak_phase = ""
        self.peak_by_tag: dict[str, int] = {}
        self.phase = ""

    # -- recording -------------------------------------------------------------------------
    def track(self, tensors: Iterable[torch.Tensor | None], tag: str = "state") -> None:
        """Record tensors that exist already (parameters, grads, optimizer state) under ``tag``."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._record(t, tag)
        self._update()

    def _record(self, t: torch.Tensor, tag: str) -> None:
        for plain in _plain_tensors(t):
            if plain.device.type == "meta":
                continue
            try:
                storage = plain.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue  # no storage (e.g. sparse)
            key = id(storage)
            if key not in self._live:
                self._live[key] = (weakref.ref(storage, lambda _, k=key: self._live.pop(k, None)), tag)

    # -- totals ----------------------------------------------------------------------------
    def current_by_tag(self) -> dict[str, int]:
        """Bytes of the live tracked storages now, per tag."""
        out: dict[str, int] = {}
        for ref, tag in list(self._live.values()):
            s = ref()
            if s is not None:
                out[tag] = out.get(tag, 0) + s.nbytes()
        return out

    def current(self) -> int:
        return sum(self.current_by_tag().values())

    def _update(self) -> None:
        by_tag = self.current_by_tag()
        total = sum(by_tag.values())
        if total > self.peak:
            self.peak, self.peak_phase, self.peak_by_tag = total, self.phase, by_tag

    def reset_peak(self) -> None:
        """Start a new peak from the current total (storages stay tracked)."""
        self.peak = 0
        self._update()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                self._record(t, "new")
        self._update()
        return out
