"""The ``FSDP<cls>`` class `fully_shard` gives a module, and what that class does not allow.

[Note: the FSDP<cls> class]
`fully_shard` swaps ``module.__class__`` for ``FSDP<cls>`` (deriving from `FSDPModule` and the
module's class; one per original class). As a plain subclass two things would go wrong:

- *New instances.* ``type(self)(...)`` (``nn.Sequential`` / ``nn.ModuleList`` slicing, ``+``,
  ``*``) would make an ``FSDP<cls>`` with no unit whose forward fails on the shared DTensor
  parameters. So ``FSDP<cls>(...)`` builds a plain ``cls`` (a slice is a plain ``nn.Sequential``
  of still-sharded children, as with FSDP2); with no arguments (``copy.copy``) it still makes
  an ``FSDP<cls>``.
- *deepcopy* of a sharded module (parameters viewing freed-and-regathered buffers, hooks tying
  modules to units) died inside torch; it raises ``AssertionError`` (FSDP2's type) saying to
  copy the module before sharding it.
"""

from __future__ import annotations

from typing import Any

from ._hf_save import save_pretrained_override
from ._module import FSDPModule

__all__ = ["fsdp_class"]

_MADE_ATTR = "_shardwise_fsdp_class"  # on an original class: its FSDP<cls>
_ORIG_ATTR = "_shardwise_orig_class"  # on an FSDP<cls>: cls


def _new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``FSDP<cls>(...)``: a plain ``cls(...)`` ([Note: the FSDP<cls> class]). Without arguments
    (``copy.copy`` and pickle call ``cls.__new__(cls)``, then restore ``__dict__``) it makes an
    ``FSDP<cls>`` as usual, so a shallow copy keeps its class."""
    if not args and not kwargs:
        return object.__new__(cls)
    orig = cls.__dict__[_ORIG_ATTR]
    new = orig.__new__
    self = new(orig) if new is object.__new__ else new(orig, *args, **kwargs)
    if isinstance(self, orig):  # Python skips __init__ when __new__ returns another class
        self.__init__(*args, **kwargs)
    return self


def _no_deepcopy(self: Any, memo: dict[int, Any]) -> Any:
    raise AssertionError(
        f"copy.deepcopy({type(self).__name__}): FSDP does not support deepcopy of a module already passed to "
        "fully_shard (its parameters are shards of flat buffers tied to the unit). Deep-copy the module before "
        "calling fully_shard, e.g. ref = copy.deepcopy(model); fully_shard(model)."
    )


def fsdp_class(cls: type) -> type:
    """``FSDP<cls>``, deriving from ``FSDPModule`` and ``cls``; one per class, kept on ``cls``."""
    if issubclass(cls, FSDPModule):
        return cls
    made = cls.__dict__.get(_MADE_ATTR)
    if made is None:
        namespace: dict[str, Any] = {"__module__": cls.__module__, _ORIG_ATTR: cls, "__new__": _new,
                                     "__deepcopy__": _no_deepcopy, **save_pretrained_override(cls)}
        made = type(f"FSDP{cls.__name__}", (FSDPModule, cls), namespace)
        setattr(cls, _MADE_ATTR, made)
    return made
