"""JSON as the checkpoint code reads it: a repeated key in an object is an error, not "last wins".

An index, a series record or a safetensors header with a key twice is damaged or hostile (two
readers could take different values), so every JSON the package reads goes through
`parse_json_strict`. A leaf module: it imports nothing of the package.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DuplicateKey", "parse_json_strict"]


class DuplicateKey(ValueError):
    """A JSON object repeats a key; the exception's argument is the key."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out


def parse_json_strict(text: str | bytes) -> Any:
    """JSON with duplicate object keys refused (`DuplicateKey`, a ValueError, names the key)."""
    return json.loads(text, object_pairs_hook=_no_duplicates)
