"""Checkpoint coordination against the world size: collectives, bytes each rank sends and
receives, rank 0's index work, for a save, a repeated save and a load.

    python benchmarks/checkpoint_scale.py --worlds 4 16 64 256 1024 4096      # simulated ranks
    python benchmarks/checkpoint_scale.py --real 4                            # real gloo ranks

Model: ``--tensors`` (1,000) fp32 tensors, each sharded on dim 0 over the whole world as
``fully_shard`` does (``Shard(0)`` on a 1-D mesh of W ranks): every rank holds one box of every
tensor, so the index has W x tensors boxes.

Simulated ranks (``--worlds``): W threads of one process, each running the real save and load
code of one rank; the module ``torch.distributed`` that the checkpoint's collectives use
(``checkpoint/_base/_comm.py``) is replaced by `SimDist`, which moves the same tensors between
the threads (the same padding, the same sizes) and counts, per rank, each collective and the
bytes it sends and receives. What is *not* run for real, because it is local work that does not
depend on other ranks and would take hours for 4,096 ranks in one process: building the
DTensors (each rank's plan is the one ``plan_save`` makes for its ``Shard(0)`` box), writing the
data (each rank's file is empty, its checksums random: ``_SimWriter``), reading data and
checking checksums at load (headers and CRCs are skipped; the share of each rank is still
worked out and exchanged), and the per-rank ``box_ids`` of the index (computed once, shared).
The index is built, checked and written for real by rank 0 (``index.json`` on the local disk).

Real ranks (``--real N``): N gloo processes save and load the same model as DTensors (small
boxes), with `CountingDist` counting the same way around the real ``torch.distributed``.

Byte conventions, per rank: all-gather and all-reduce as a ring (all-gather: (W-1) x the
input, sent and received; all-reduce: 2 (W-1)/W x the tensor each way); gather/scatter/
broadcast/point-to-point: what the rank's tensors hold (the root receives or sends every other
rank's part). ``recv max`` is the largest over the ranks (rank 0), ``recv other`` the largest
over the ranks other than 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks`, `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as _real_dist  # noqa: E402

MiB = 2**20


def _nbytes(ts) -> int:
    if isinstance(ts, torch.Tensor):
        return ts.numel() * ts.element_size()
    return sum(_nbytes(t) for t in ts or ())


class CountingDist:
    """A stand-in for the module ``torch.distributed`` that forwards every call to ``backend``
    (the real module by default) and counts, for this process's rank, the collectives the
    checkpoint code issues and their bytes (module docstring). ``stats[rank]`` is a `Counter`
    with ``calls``, ``sent``, ``recv`` and ``calls:<kind>``."""

    def __init__(self, backend: Any = _real_dist) -> None:
        self._b = backend
        self.stats: dict[int, Counter] = {}
        self.ReduceOp = _real_dist.ReduceOp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._b, name)

    def _count(self, kind: str, sent: float, recv: float) -> None:
        c = self.stats.setdefault(self.get_rank(), Counter())
        c["calls"] += 1
        c[f"calls:{kind}"] += 1
        c["sent"] += sent
        c["recv"] += recv

    def get_rank(self, group=None) -> int:
        return self._b.get_rank()

    def get_world_size(self, group=None) -> int:
        return self._b.get_world_size()

    def all_reduce(self, t, op=None, **kw):
        w = self.get_world_size()
        self._count("all_reduce", 2 * (w - 1) / w * _nbytes(t), 2 * (w - 1) / w * _nbytes(t))
        return self._b.all_reduce(t, op=op if op is not None else self.ReduceOp.SUM, **kw)

    def all_gather(self, out, t, **kw):
        w = self.get_world_size()
        self._count("all_gather", (w - 1) * _nbytes(t), (w - 1) * _nbytes(t))
        return self._b.all_gather(out, t, **kw)

    def gather(self, t, gather_list=None, dst=0, **kw):
        me = self.get_rank() == dst
        self._count("gather", 0 if me else _nbytes(t), _nbytes(gather_list) - _nbytes(t) if me else 0)
        return self._b.gather(t, gather_list, dst=dst, **kw)

    def scatter(self, t, scatter_list=None, src=0, **kw):
        me = self.get_rank() == src
        self._count("scatter", _nbytes(scatter_list) - _nbytes(t) if me else 0, 0 if me else _nbytes(t))
        return self._b.scatter(t, scatter_list, src=src, **kw)

    def broadcast(self, t, src=0, **kw):
        me = self.get_rank() == src
        self._count("broadcast", _nbytes(t) if me else 0, 0 if me else _nbytes(t))
        return self._b.broadcast(t, src=src, **kw)

    def send(self, t, dst, **kw):
        self._count("send", _nbytes(t), 0)
        return self._b.send(t, dst, **kw)

    def isend(self, t, dst, **kw):
        self._count("send", _nbytes(t), 0)
        return self._b.isend(t, dst, **kw)

    def recv(self, t, src=None, **kw):
        self._count("recv", 0, _nbytes(t))
        return self._b.recv(t, src, **kw)

    def irecv(self, t, src=None, **kw):
        self._count("recv", 0, _nbytes(t))
        return self._b.irecv(t, src, **kw)


class _Done:
    def wait(self, *a, **k) -> bool:
        return True


class _RecvWork:
    def __init__(self, box: queue.Queue, t: torch.Tensor) -> None:
        self._box, self._t = box, t

    def wait(self, *a, **k) -> bool:
        self._t.copy_(self._box.get(timeout=600))
        return True


class _SimGroup:
    """A simulated rank's world group."""

    @property
    def WORLD(self) -> "_SimGroup":
        return self


class SimDist:
    """``torch.distributed`` for W threads of one process (thread i is rank i): each collective
    meets at a barrier, one thread works out every rank's result, each copies its own."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._local = threading.local()
        self._slots: list[Any] = [None] * world
        self._results: list[Any] = [None] * world
        self._meet = threading.Barrier(world, action=self._resolve)
        self._leave = threading.Barrier(world)
        self._p2p: dict[tuple[int, int], queue.Queue] = {}
        self._p2p_lock = threading.Lock()
        self.ReduceOp = _real_dist.ReduceOp

    def set_rank(self, rank: int) -> None:
        self._local.rank = rank
        self._local.group = _SimGroup()

    @property
    def group(self) -> Any:
        """``dist.group``: each simulated rank's own ``WORLD`` (what a save's agreement is kept on,
        one per process in a real job)."""
        return self._local.group

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group=None) -> int:
        return self._local.rank

    def get_world_size(self, group=None) -> int:
        return self.world

    def get_backend(self, group=None) -> str:
        return "gloo"

    def _round(self, item: Any) -> Any:
        r = self.get_rank()
        self._slots[r] = item
        self._meet.wait()
        out = self._results[r]
        self._leave.wait()
        return out

    def _resolve(self) -> None:
        kind = self._slots[0][0]
        assert all(s[0] == kind for s in self._slots), f"ranks disagree on the collective: {set(s[0] for s in self._slots)}"
        W = self.world
        if kind == "all_reduce":
            op = self._slots[0][2]
            stack = torch.stack([s[1] for s in self._slots])
            red = {self.ReduceOp.MAX: lambda x: x.max(0).values, self.ReduceOp.MIN: lambda x: x.min(0).values,
                   self.ReduceOp.SUM: lambda x: x.sum(0)}[op](stack)
            self._results = [red] * W
        elif kind == "all_gather":
            ins = [s[1] for s in self._slots]
            self._results = [ins] * W
        elif kind == "gather":
            dst = self._slots[0][2]
            self._results = [[s[1] for s in self._slots] if r == dst else None for r in range(W)]
        elif kind == "scatter":
            src = self._slots[0][2]
            chunks = self._slots[src][1]
            self._results = list(chunks)
        elif kind == "broadcast":
            src = self._slots[0][2]
            self._results = [self._slots[src][1]] * W
        else:
            raise AssertionError(kind)

    def all_reduce(self, t, op=None, **kw):
        t.copy_(self._round(("all_reduce", t.clone(), op if op is not None else self.ReduceOp.SUM)))

    def all_gather(self, out, t, **kw):
        for o, x in zip(out, self._round(("all_gather", t.clone()))):
            o.copy_(x)

    def gather(self, t, gather_list=None, dst=0, **kw):
        got = self._round(("gather", t.clone(), dst))
        if got is not None:
            for o, x in zip(gather_list, got):
                o.copy_(x)

    def scatter(self, t, scatter_list=None, src=0, **kw):
        t.copy_(self._round(("scatter", [c.clone() for c in scatter_list] if scatter_list else None, src)))

    def broadcast(self, t, src=0, **kw):
        t.copy_(self._round(("broadcast", t.clone(), src)))

    def _box(self, src: int, dst: int) -> queue.Queue:
        with self._p2p_lock:
            return self._p2p.setdefault((src, dst), queue.Queue())

    def send(self, t, dst, **kw):
        self._box(self.get_rank(), dst).put(t.clone())

    def isend(self, t, dst, **kw):
        self.send(t, dst)
        return _Done()

    def recv(self, t, src=None, **kw):
        _RecvWork(self._box(src, self.get_rank()), t).wait()

    def irecv(self, t, src=None, **kw):
        return _RecvWork(self._box(src, self.get_rank()), t)


# ---------------------------------------------------------------------------------------------
# the model and one rank's plan


def tensor_names(n: int) -> list[str]:
    parts = ["attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
             "feed_forward.w2", "feed_forward.w3", "attention_norm", "ffn_norm"]
    return [f"model.layers.{i // len(parts)}.{parts[i % len(parts)]}.weight" for i in range(n)]


COLS = 4  # columns of every tensor (the data is never written; the box geometry is what counts)


def sim_plan(rank: int, world: int, names: list[str]):
    """The plan ``plan_save`` makes on ``rank`` for ``Shard(0)`` DTensors of ``2 * world`` rows."""
    from shardwise.checkpoint._geometry import Box
    from shardwise.checkpoint._save._save_plan import Piece, SavePlan

    plan = SavePlan()
    layout = {"mesh_shape": [world], "mesh_dim_names": ["dp"], "placements": ["Shard(dim=0)"]}
    data = torch.empty(2, COLS)
    for k in names:
        plan.meta[k] = {"dtype": "float32", "shape": [2 * world, COLS], "layout": layout}
        plan.pieces.append(Piece(k, Box((2 * rank, 0), (2, COLS)), data, Box((0, 0), (2, COLS))))
    plan.values["step"] = 100
    return plan


class _SimWriter:
    """``StreamingWriter`` without the data: a sparse file of the data's size, random checksums."""

    def __init__(self, path, entries, metadata=None, chunk_rule=None, storage=None) -> None:
        self.keys = [k for k, _, _ in entries]
        self._path, self._storage = path, storage
        self._bytes = sum(dtype.itemsize * int(torch.Size(sizes).numel()) for _, dtype, sizes in entries)

    def append(self, t) -> None:
        pass

    def abort(self) -> None:
        pass

    def close(self):
        from shardwise.checkpoint._base import BoxChecksums

        with open(self._path, "wb") as f:
            f.truncate(self._bytes)
        g = torch.Generator().manual_seed(hash(self._path) & 0xFFFF)
        crcs = torch.randint(0, 2**31, (len(self.keys),), generator=g).tolist()
        return {k: BoxChecksums(c) for k, c in zip(self.keys, crcs)}


class _SimFiles:
    """What ``load`` needs of an opened checkpoint, around an index held in memory."""

    def __init__(self, index, where: str) -> None:
        self.index, self.where = index, where
        self.view = type("V", (), {"pinned": True})()

    def replaced(self) -> bool:
        return False

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _patched(obj, **attrs):
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def simulate(world: int, n_tensors: int, root: str, saves: int = 2, load: bool = True) -> dict:
    """Save ``saves`` times and load once on ``world`` simulated ranks; per step, the counts."""
    from shardwise.checkpoint._base import _comm
    from shardwise.checkpoint._format import read_index
    from shardwise.checkpoint._geometry import Box, ReadItem
    from shardwise.checkpoint._load import _load_checks, _reader, _verify_shares
    from shardwise.checkpoint._load._reads import Read
    from shardwise.checkpoint._save import _save_handle, _save_plan, _writer

    names = tensor_names(n_tensors)
    sim = SimDist(world)
    counter = CountingDist(sim)
    timings: dict[str, float] = {}
    built: dict[str, Any] = {}
    real_build = _save_handle.build_index

    def timed_build(*a, **k):
        t0 = time.perf_counter()
        index = real_build(*a, **k)
        timings["build_index_s"] = time.perf_counter() - t0
        built["index"] = index
        return index

    def fmt(obj):
        t0 = time.perf_counter()
        out = real_format(obj)
        timings["index_json_s"] = timings.pop("to_json_s", 0) + time.perf_counter() - t0
        timings["index_bytes"] = len(out)
        return out

    real_format, real_to_json = _save_handle.format_index, _save_handle.index_to_json

    def to_json(index):
        t0 = time.perf_counter()
        out = real_to_json(index)
        timings["to_json_s"] = time.perf_counter() - t0
        return out

    def shared(fn):
        """``fn(index)``, worked out once for all simulated ranks (each rank does it in a real load)."""
        memo: dict[int, Any] = {}
        lock = threading.Lock()

        def once(index):
            with lock:
                if id(index) not in memo:
                    memo[id(index)] = fn(index)
                return memo[id(index)]
        return once

    shared_box_ids = shared(_load_checks.box_ids)
    read_lock = threading.Lock()

    def read_once():
        """The committed index, read (its parts too) once for all simulated ranks."""
        with read_lock:
            if "read" not in built:
                t0 = time.perf_counter()
                built["read"] = read_index(os.path.join(root, "ckpt"))
                timings["read_index_s"] = time.perf_counter() - t0
            return built["read"]

    def sim_plan_load(view, leaves, strict, where):
        reads = []
        local = torch.empty(2, COLS)
        for leaf in leaves:
            entry = view.tensors[leaf.key]
            rank = sim.get_rank()
            saved = next((b for b in entry.boxes[rank:rank + 1] if b.box.offsets[0] == 2 * rank), None)
            if saved is None:
                saved = next(b for b in entry.boxes if b.box.offsets[0] == 2 * rank)
            reads.append(Read(leaf.key, local, saved, ReadItem(0, Box((0, 0), (2, COLS)), Box((0, 0), (2, COLS)))))
        return reads, []

    results: dict[str, list[Counter]] = {}
    errors: list[BaseException] = []
    step_names = [f"save {i + 1}" for i in range(saves)] + (["load"] if load else [])
    state_leaves = {k: torch.empty(0) for k in names}

    def body(rank: int) -> None:
        sim.set_rank(rank)
        try:
            for s in range(saves):
                before = Counter(counter.stats.get(rank, Counter()))
                _writer._start({}, os.path.join(root, "ckpt"), None, None, None, None).wait()
                results.setdefault(step_names[s], [None] * world)[rank] = counter.stats[rank] - before
            if not load:
                return
            before = Counter(counter.stats.get(rank, Counter()))
            files = _SimFiles(read_once(), "sim")
            _comm.agree(None, "loading sim")  # the agreement on opening it
            _reader.agree_version(files, "loading sim")
            _reader.load_from_index(state_leaves, files, strict=True, verify=True)
            results.setdefault("load", [None] * world)[rank] = counter.stats[rank] - before
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            raise

    no_share = lambda index, keys, ids, needs, rank, world: []  # noqa: E731
    noop_headers = lambda files, uses, problems: {(b.file, b.key) for _, b in uses}  # noqa: E731
    old_stack = threading.stack_size(1 << 20)
    t0 = time.perf_counter()
    try:
        with _patched(_comm, dist=counter), _patched(_save_plan, StreamingWriter=_SimWriter), \
                _patched(_writer, plan_save=lambda state, r: sim_plan(r, world, names)), \
                _patched(_save_handle, build_index=timed_build, format_index=fmt, index_to_json=to_json), \
                _patched(_load_checks, box_ids=shared_box_ids, _check_headers=noop_headers,
                         **({"share_of": no_share} if hasattr(_load_checks, "share_of") else {}),
                         **({"id_boxes": shared(_load_checks.id_boxes)} if hasattr(_load_checks, "id_boxes") else {}),
                         _check_share=lambda files, share, good, problems: 0), \
                _patched(_reader, _plan_load=sim_plan_load, _read=lambda files, reads, m: (0, 0)):
            threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        threading.stack_size(old_stack)
    if errors:
        raise errors[0]
    del _verify_shares
    index = built["index"]
    return {"world": world, "steps": {k: results[k] for k in step_names}, "timings": timings,
            "wall_s": time.perf_counter() - t0, "index_boxes": world * n_tensors, "parts": len(index.parts)}


def summary(per_rank: list[Counter]) -> dict:
    other = per_rank[1:] or per_rank
    return {"calls": max(c["calls"] - c["calls:send"] - c["calls:recv"] for c in per_rank),
            "p2p": max(c["calls:send"] + c["calls:recv"] for c in per_rank), "recv_max": max(c["recv"] for c in per_rank),
            "recv_other": max(c["recv"] for c in other), "sent_max": max(c["sent"] for c in per_rank),
            "sent_other": max(c["sent"] for c in other),
            "kinds": {k[6:]: v for k, v in sorted(per_rank[0].items()) if k.startswith("calls:")}}


def _fmt_bytes(n: float) -> str:
    return f"{n / MiB:.2f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"


def print_table(rows: list[dict]) -> None:
    print("| W | step | collectives | point-to-point messages (rank 0) | recv rank 0 | recv max other rank | "
          "sent max other rank |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        for step, per_rank in r["steps"].items():
            s = summary(per_rank)
            kinds = ", ".join(f"{k} {v}" for k, v in s["kinds"].items() if k not in ("send", "recv"))
            print(f"| {r['world']} | {step} | {s['calls']} ({kinds}) | {s['p2p']} | {_fmt_bytes(per_rank[0]['recv'])} | "
                  f"{_fmt_bytes(s['recv_other'])} | {_fmt_bytes(s['sent_other'])} |")
    print("\n| W | boxes | index parts | rank 0 build_index s (last save) | index to JSON s | index.json | "
          "read_index s (at load) | wall s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        t = r["timings"]
        print(f"| {r['world']} | {r['index_boxes']:,} | {r.get('parts', 0):,} | {t.get('build_index_s', float('nan')):.2f} | "
              f"{t.get('index_json_s', float('nan')):.2f} | {_fmt_bytes(t.get('index_bytes', 0))} | "
              f"{t.get('read_index_s', float('nan')):.2f} | {r['wall_s']:.0f} |")


# ---------------------------------------------------------------------------------------------
# real gloo ranks


def real_rank(rank: int, world: int, n_tensors: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardwise.checkpoint import load, save
    from shardwise.checkpoint._base import _comm

    mesh = init_device_mesh("cpu", (world,))
    names = tensor_names(n_tensors)
    state = {k: distribute_tensor(torch.arange(2 * world * COLS, dtype=torch.float32).reshape(2 * world, COLS) + i,
                                  mesh, [Shard(0)]) for i, k in enumerate(names)}
    state["step"] = 100
    counter = CountingDist()
    out = {}
    with _patched(_comm, dist=counter):
        for step in ("save 1", "save 2"):
            before = Counter(counter.stats.get(rank, Counter()))
            save(state, os.path.join(root, "ckpt"))
            out[step] = counter.stats[rank] - before
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
        before = Counter(counter.stats.get(rank, Counter()))
        load(target, os.path.join(root, "ckpt"))
        out["load"] = counter.stats[rank] - before
    assert all(torch.equal(target[k].to_local(), state[k].to_local()) for k in names)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="*", default=[4, 16, 64, 256, 1024, 4096])
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--no-load-above", type=int, default=1 << 30,
                   help="simulate only the saves for worlds larger than this (today's load is quadratic to simulate)")
    p.add_argument("--real", type=int, default=0, help="also run this many real gloo ranks")
    args = p.parse_args(argv)
    rows = []
    print(f"{args.tensors} tensors, Shard(0) over the world; torch {torch.__version__}\n", flush=True)
    if args.real:
        from benchmarks import checkpoint_scale as this
        from tests._dist import run_ranks

        root = tempfile.mkdtemp(prefix="ckpt-scale-real-")
        try:
            per_rank = run_ranks(this.real_rank, args.real, args.tensors, root, timeout=600)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        rows.append({"world": f"{args.real} (gloo)", "steps": {k: [r[k] for r in per_rank] for k in per_rank[0]},
                     "timings": {}, "index_boxes": args.real * args.tensors, "wall_s": float("nan")})
    for w in args.worlds:
        root = tempfile.mkdtemp(prefix="ckpt-scale-")
        try:
            rows.append(simulate(w, args.tensors, root, load=w <= args.no_load_above))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(f"  W={w} done in {rows[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
