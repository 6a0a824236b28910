"""A pickle reader that runs no code from the file: every global it meets is looked up in an
allowlist of *our own* objects.

[Note: reading a pickle without running it]
Every way ``pickle`` imports or calls something goes through ``Unpickler.find_class`` (``GLOBAL``,
``STACK_GLOBAL``, ``EXT``, ``INST``/``OBJ``), and the only other object-creating hook is
``persistent_load``. `SafeUnpickler` overrides both: ``find_class`` returns ``allowed[(module,
name)]`` (a look-alike dataclass, a checking function, a ``torch.dtype``) or raises
`RefusedGlobal` naming it; ``persistent_load`` refuses unless the caller gave a handler. So only
this package's allowlisted code runs, and nothing of torch's DCP package is imported.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any

from .._base import CheckpointError

__all__ = ["Call", "RefusedGlobal", "SafeUnpickler", "safe_loads"]


class Call:
    """An allowlisted function, as ``find_class`` hands it out. ``REDUCE`` calls it; ``BUILD``
    on it is refused (a bare function would let ``BUILD`` set its attributes, e.g. its
    ``__defaults__``, for the rest of the process); it is no class, so ``NEWOBJ`` refuses it.
    Look-alike classes are handed out as themselves: each defines ``__setstate__``, so
    ``BUILD`` on the class object fails (called without an instance) instead of setting
    attributes on it."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def __setstate__(self, state: Any) -> None:
        raise CheckpointError("the pickle tries to change an allowlisted function (BUILD on it); refusing it")


class RefusedGlobal(CheckpointError):
    """The pickle names a class or function that is not on the allowlist."""


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose globals come only from ``allowed`` (see the module note)."""

    def __init__(self, data: bytes, allowed: Mapping[tuple[str, str], Any], where: str,
                 persistent: Callable[[Any], Any] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed, self._where, self._persistent = allowed, where, persistent

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            raise RefusedGlobal(
                f"{self._where}: refusing to unpickle {str(module)[:80]}.{str(name)[:80]}: import-dcp admits only the "
                "classes of DCP's metadata, tensor records and plain values (nothing from the file was run; the file "
                "may be malicious, or written by a torch this shardwise does not know)") from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise CheckpointError(f"{self._where}: the pickle refers to external data (a persistent id), which this "
                                  "kind of file never has; refusing it")
        return self._persistent(pid)


def safe_loads(data: bytes, allowed: Mapping[tuple[str, str], Any], where: str,
               persistent: Callable[[Any], Any] | None = None) -> Any:
    """The object pickled in ``data``, read by `SafeUnpickler`; any problem (a refused global,
    a damaged or truncated pickle, an allowlisted function refusing its arguments) is one
    `CheckpointError` naming ``where``."""
    try:
        return SafeUnpickler(data, allowed, where, persistent).load()
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError(f"{where}: the pickle nests too deeply; refusing it") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            OverflowError, MemoryError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: not a readable pickle ({type(e).__name__}: {str(e)[:120]}); the file is "
                              "damaged or not a torch DCP file") from None
