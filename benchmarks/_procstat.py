"""Per-process memory and I/O counters from ``/proc`` (Linux), for `benchmarks/checkpoint.py`.

    reset_peak_rss()                     # VmHWM := VmRSS now (writes 5 to /proc/self/clear_refs)
    before, io0 = rss_bytes(), io_counters()
    ...                                  # the operation
    peak_delta = peak_rss_bytes() - before
    read = io_counters()["read_bytes"] - io0["read_bytes"]

``VmHWM`` is the kernel's own high-water mark of the resident set (anonymous memory, file pages
mapped into the process, shared memory), so no sampling is needed and no short spike is missed.
Page cache that the process only reads or writes through ``read``/``write`` is not in it; file
pages it maps (``mmap``, as ``safetensors.safe_open`` does) are, while mapped.

``read_bytes`` counts the bytes this process caused to be fetched from the storage device
(read-ahead included); bytes served from the page cache do not count, so it measures what was
read only with a cold page cache (`drop_page_cache`, root only). ``rchar`` counts the bytes
returned by ``read``-family calls, cached or not, and misses ``mmap`` reads.
"""

from __future__ import annotations

import os

__all__ = ["rss_bytes", "peak_rss_bytes", "reset_peak_rss", "io_counters", "can_drop_page_cache",
           "drop_page_cache"]

_DROP = "/proc/sys/vm/drop_caches"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Resident set size now (``VmRSS``)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size since the process started or `reset_peak_rss` (``VmHWM``)."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Set ``VmHWM`` to the current ``VmRSS`` (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def io_counters() -> dict[str, int]:
    """``/proc/self/io`` as a dict (``rchar``, ``read_bytes``, ``wchar``, ``write_bytes``, ...)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f if ":" in line)}


def can_drop_page_cache() -> bool:
    return os.access(_DROP, os.W_OK)


def drop_page_cache() -> None:
    """Write back dirty pages, then drop the clean page cache (system wide; root only)."""
    os.sync()
    with open(_DROP, "w") as f:
        f.write("1")
