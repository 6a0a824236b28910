"""Loading: `load`, the reads each rank does, and the checks of what it read."""

from ._reader import LoadStats, load, load_from_index
from ._reads import read_region

__all__ = ["LoadStats", "load", "load_from_index", "read_region"]
