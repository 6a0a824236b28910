"""The file checks of a load (step 1 of [Note: the steps of a load] in ``_reader.py``), before any
target tensor is written: sizes, keys, dtypes and shapes of each data file (`_check_headers`);
with ``verify`` this rank's share of the checksum units ([Note: verification shares] in
``_verify_shares.py``; `_check_share`). `check_files` returns the problems as one error to agree on.
"""

from __future__ import annotations

import functools
from collections import defaultdict

from .._base import CheckpointError, gather_json, rank_and_world, scatter_json
from .._format import CheckpointFiles, SavedBox, crcs_of_ranges
from .._geometry import Box
from ._reads import run_bounded
from ._verify_shares import (Unit, all_shares, box_ids, contiguous_runs, id_boxes, keys_to_mask, mask_to_keys, needs_of,
                             pack_ints, units_of, unpack_ints)

__all__ = ["check_files"]

_MAX_PROBLEMS = 20


def _check_headers(files: CheckpointFiles, uses: list[tuple[str, SavedBox]],
                   problems: list[str]) -> set[tuple[str, str]]:
    """Check the data files of ``uses`` (``(tensor key, saved box)``) with the shared file checker
    (``CheckpointFiles.header``: present, regular, of the recorded size, a valid header) and that
    each holds its box's key with the tensor's dtype and the box's shape. Returns the boxes
    (``(file, key)``) found as expected."""
    checked: set[tuple[str, str]] = set()
    good: set[tuple[str, str]] = set()
    bad_files: set[str] = set()
    run_bounded([functools.partial(_try_header, files, n) for n in dict.fromkeys(b.file for _, b in uses)],
                getattr(files.storage, "read_concurrency", 1))  # the headers read together; errors said below
    for key, box in uses:
        name = box.file
        if name in bad_files or (name, box.key) in checked:
            continue
        try:
            files.header(name)
        except CheckpointError as e:
            problems.append(f"{e} (it holds tensor '{key}')")
            bad_files.add(name)
            continue
        checked.add((name, box.key))
        problem = files.box_problem(key, box)
        if problem:
            problems.append(problem)
        else:
            good.add((name, box.key))
    return good


def _try_header(files: CheckpointFiles, name: str) -> None:
    try:
        files.header(name)
    except CheckpointError:
        pass


def _check_share(files: CheckpointFiles, share: list[Unit], good: set[tuple[str, str]], problems: list[str]) -> int:
    """Check the CRC-32 of every unit of ``share`` whose box passed `_check_headers` (is in
    ``good``); returns the bytes checksummed. Each data file is opened once (and stays open for
    the reads); consecutive chunks of one box, and runs of chunks that follow one another in the
    file, are read as one range (4 MiB at a time)."""
    by_file: dict[str, list[list[Unit]]] = defaultdict(list)
    for run in contiguous_runs(u for u in share if (u.saved.file, u.saved.key) in good):
        by_file[run[0].saved.file].append(run)
    results = run_bounded([functools.partial(_check_file, files, n, r) for n, r in sorted(by_file.items())],
                          getattr(files.storage, "read_concurrency", 1))
    for _, said in results:
        problems += said
    return sum(n for n, _ in results)


def _check_file(files: CheckpointFiles, name: str, runs: list[list[Unit]]) -> tuple[int, list[str]]:
    """`_check_share` for the runs of one data file: (bytes checksummed, problems)."""
    header = files.header(name)
    h = files.handle(name)
    verified, problems = 0, []
    try:
        spans = []
        for run in runs:
            first, last = run[0], run[-1]
            start = header.data_start + header.entries[first.saved.key].begin
            # a run starts at a chunk boundary, so its first chunk is full-sized (only a
            # box's last chunk can be shorter): first.nbytes is the run's chunk size
            spans.append((start + first.lo * first.row_bytes, start + last.hi * first.row_bytes, first.nbytes))
        for run, crc in zip(runs, crcs_of_ranges(h, spans, h.name)):
            verified += crc.total
            for u, got in zip(run, crc.chunks()):
                if got != u.crc32:
                    problems.append(f"checksum mismatch in data file {h.name}, key '{u.saved.key}' (tensor "
                                    f"'{u.tensor}', {u.where()}): the file is corrupted; restore it or load "
                                    "another checkpoint")
    except CheckpointError as e:
        problems.append(str(e))
    return verified, problems


def check_files(files: CheckpointFiles, keys: list[str], reads: list[tuple[str, SavedBox, Box, int]], verify: bool,
                problems: list[str], error: BaseException | str | None) -> tuple[int, BaseException | str | None]:
    """The file checks of step 1 of [Note: the steps of a load]: sizes and headers of the files
    read, and with ``verify`` the checksums of this rank's share (collective: a gather to rank 0
    and a scatter of the shares, taken part in even by a rank whose planning failed, so no rank
    hangs).

    ``keys``: the tensors this rank loads; ``reads``: ``(tensor key, saved box, region of the
    saved box, itemsize)`` for each planned read; ``problems``: the planning's, appended to;
    ``error``: the planning's error, if any. Opens (and keeps open) every data file read; returns the bytes checksummed
    and the error to agree on (``error``, or one listing the problems)."""
    index = files.index
    verified = 0
    share: list[Unit] = []
    rank, world = rank_and_world()
    if verify:  # every rank takes part, even one whose planning failed (no hang)
        mine: dict = {"keys": keys_to_mask(index, []), "needs": pack_ints([], 4)}
        ids = box_ids(index)
        try:
            if error is None:
                mine = {"keys": keys_to_mask(index, keys),
                        "needs": pack_ints(needs_of(((saved.file, saved.key, src, itemsize)
                                                     for _, saved, src, itemsize in reads), ids), 4)}
        except Exception as e:
            error = e
        gathered = gather_json(mine, dst=0)
        answers: list[dict] | None = None
        if gathered is not None:  # rank 0: every rank's share ([Note: verification shares])
            try:
                union = mask_to_keys(index, [g["keys"] for g in gathered])
                needs = [unpack_ints(g["needs"], 4) for g in gathered]
                answers = [{"share": pack_ints(s, 3)} for s in all_shares(index, union, ids, needs, world)]
            except Exception as e:  # every rank learns it in the agreement that follows
                answers = [{"error": f"{type(e).__name__}: {e}"}] * world
        answer = scatter_json(answers)
        if error is None and "error" in answer:
            error = f"working out the verification shares on rank 0 failed: {answer['error']}"
    try:
        if verify and error is None:
            # the units are those of every tensor any rank loads, numbered the same way
            # everywhere, so each is checked by exactly one rank
            share = units_of(index, id_boxes(index), unpack_ints(answer["share"], 3))
        if error is None:
            uses = [(key, saved) for key, saved, _, _ in reads] + [(u.tensor, u.saved) for u in share]
            good = _check_headers(files, uses, problems)
            verified = _check_share(files, share, good, problems)
    except Exception as e:
        error = e
    if problems and error is None:
        more = len(problems) - _MAX_PROBLEMS
        shown = problems[:_MAX_PROBLEMS] + ([f"... and {more} more problems"] if more > 0 else [])
        error = "\n    ".join(shown) + "\n  The target was not modified."
    return verified, error
