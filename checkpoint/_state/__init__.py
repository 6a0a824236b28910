"""State trees: flattening them, `Stateful` objects, full (unsharded) state, the state-dict helpers."""

from ._dcp_api import (DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter, async_checkpointer_kind, check_alone_state, checkpoint_path,
                       dcp_scope, refuse_dcp_extensions, requested_async_checkpointer)
from ._flatten import Leaf, flatten, join_key, rank_key, set_values, to_json_value
from ._full_state import gather_full, scatter_full
from ._state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict,
                          set_model_state_dict, set_optimizer_state_dict, set_state_dict)
from ._stateful import Stateful, expand_stateful

__all__ = ["DefaultLoadPlanner", "DefaultSavePlanner", "FileSystemReader", "FileSystemWriter", "Leaf", "StateDictOptions", "Stateful", "async_checkpointer_kind",
           "check_alone_state",
           "checkpoint_path", "dcp_scope", "expand_stateful", "flatten", "gather_full", "get_model_state_dict", "get_optimizer_state_dict",
           "get_state_dict", "join_key", "rank_key", "refuse_dcp_extensions", "requested_async_checkpointer", "scatter_full", "set_model_state_dict",
           "set_optimizer_state_dict", "set_state_dict", "set_values", "to_json_value"]
