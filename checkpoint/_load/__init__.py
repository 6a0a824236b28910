"""Loading: `load`, the reads each rank does, and the checks of what it read.

| module | one line |
| --- | --- |
| `_reads.py` | read a region of a saved tensor from its boxes |
| `_load_plan.py` | the reads that fill each rank's boxes |
| `_verify_shares.py` | which rank checks which checksum chunk ([Note: verification shares]) |
| `_load_checks.py` | the checks before and after reading: structure, tiling, checksums |
| `_reader.py` | `load`, `load_from_index`, `LoadStats` |
"""

from ._reader import LoadStats, load, load_from_index
from ._reads import read_region

__all__ = ["LoadStats", "load", "load_from_index", "read_region"]
