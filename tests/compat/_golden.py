"""Golden data: the torch side of a differential test, recorded once.

A differential test runs a scenario on torch's implementation and on shardwise's and compares
them. torch's side depends only on the pinned torch (and client) releases, so it is not rerun on
every test run: a test module registers the function that produces it,

    @recorder("lightning_fabric_fsdp", clients=("lightning",))
    def _torch_fabric_fsdp(tmp: pathlib.Path):
        return flow("torch", str(tmp / "torch.ckpt"), 2, 1)

and the test reads what it returned with ``golden("lightning_fabric_fsdp")`` (`record_each`
registers one per scenario of a table). The function runs
only in ``python -m tests.compat.regen_goldens [NAME ...]`` (all names when none are given),
which writes ``tests/compat/goldens/NAME.json``: the data and the releases it was made with
(torch and each client of ``clients``). `tests/compat/test_goldens.py` checks that every golden
was made by the installed releases, which are the pinned ones (a new pin means regenerating),
that every registered name has its file and every file a recorder, and regenerates the cheapest
one to see it equal its file (slow tier).

Values go through JSON: numbers exactly (Python's float repr round-trips), tuples become lists,
a tensor a ``{"__tensor__": dtype, "shape", "values"}`` record decoded back to the same tensor
bit for bit (fp32 / fp64 / ints / bool values are exact as JSON numbers).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import pathlib
import re
from collections.abc import Callable
from typing import Any

GOLDENS = pathlib.Path(__file__).with_name("goldens")
COMPAT = pathlib.Path(__file__).parent


@dataclasses.dataclass(frozen=True)
class Recorder:
    """A golden's producer: ``fn(scratch_dir)`` returns torch's side (JSON-able, or tensors)."""

    name: str
    module: str
    fn: Callable[[pathlib.Path], Any]
    clients: tuple[str, ...]


RECORDERS: dict[str, Recorder] = {}


def recorder(name: str, clients: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the producer of golden ``name`` (``clients``: the distributions whose
    releases the data depends on besides torch)."""

    def register(fn: Callable) -> Callable:
        old = RECORDERS.get(name)
        if old is not None and (old.module, old.fn.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"golden {name!r} is recorded by {old.module}.{old.fn.__qualname__} already")
        RECORDERS[name] = Recorder(name, fn.__module__, fn, tuple(clients))
        return fn

    return register


def record_each(scenarios: dict[str, tuple], run: Callable[..., Any], clients: tuple[str, ...] = ()) -> None:
    """One recorder per scenario: golden ``name`` is what ``run(scratch_dir, *args)`` returns,
    for each ``name: args`` of ``scenarios``."""
    for name, args in scenarios.items():
        def torch_side(tmp: pathlib.Path, args: tuple = args) -> Any:
            return run(tmp, *args)

        torch_side.__module__, torch_side.__qualname__ = run.__module__, f"{run.__qualname__}{args!r}"
        recorder(name, clients)(torch_side)


def recorded_run_test(scenarios: dict[str, tuple], check: Callable[..., None]) -> Callable[[str], None]:
    """The test that torch's recorded runs of a table (as `record_each` registered them) pass the
    checks shardwise's run passes: ``check("torch", data, data, *args)`` for each golden; assign it
    to a module-level ``test_...`` name."""
    import pytest

    @pytest.mark.parametrize("name", sorted(scenarios))
    def test(name: str) -> None:
        torch_side = golden(name)
        check("torch", torch_side, torch_side, *scenarios[name])

    return test


def releases(clients: tuple[str, ...] = ()) -> dict[str, str]:
    """The installed releases a golden depends on: torch's and each client's."""
    import torch

    return {"torch": torch.__version__, **{c: importlib.metadata.version(c) for c in clients}}


def encode(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return {"__tensor__": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "values": t.reshape(-1).tolist()}
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"golden data: dict keys must be str, got {bad[:3]}")
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"golden data: cannot record a {type(value).__name__}")


def decode(value: Any) -> Any:
    import torch

    if isinstance(value, dict):
        if "__tensor__" in value:
            dtype = getattr(torch, value["__tensor__"])
            return torch.tensor(value["values"], dtype=dtype).reshape(value["shape"])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def path_of(name: str) -> pathlib.Path:
    return GOLDENS / f"{name}.json"


def read(name: str) -> dict[str, Any]:
    """The golden file's record: ``{"name", "releases", "data"}`` (data still encoded)."""
    path = path_of(name)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no golden data for {name!r}; run python -m tests.compat.regen_goldens {name}")
    return json.loads(path.read_text())


def golden(name: str) -> Any:
    """torch's side of ``name``, as its recorder returned it (tensors decoded)."""
    return decode(read(name)["data"])


def write(name: str, data: Any, clients: tuple[str, ...]) -> pathlib.Path:
    GOLDENS.mkdir(exist_ok=True)
    path = path_of(name)
    record = {"name": name, "releases": releases(clients), "data": encode(data)}
    path.write_text(dumps(record))
    return path


def dumps(record: dict[str, Any]) -> str:
    """The file's text: indented, each list of plain values (a tensor's, a run's losses) on one line."""
    text = json.dumps(record, indent=1, sort_keys=True)
    return re.sub(r"\[([^\[\]{}\"]*)\]", lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")
                                                          if v.strip()) + "]", text) + "\n"


def load_recorders() -> dict[str, Recorder]:
    """Import every test module of tests/compat (their recorders register at import)."""
    for path in sorted(COMPAT.glob("test_*.py")):
        importlib.import_module(f"tests.compat.{path.stem}")
    return RECORDERS
