"""State trees: flattening them, `Stateful` objects, full (unsharded) state, the state-dict helpers.

| module | one line |
| --- | --- |
| `_flatten.py` | a state tree as flat ``a/b/0`` keys and back |
| `_stateful.py` | `Stateful`: objects saved through their ``state_dict`` / ``load_state_dict`` |
| `_dcp_api.py` | the calling conventions of torch DCP's ``save``/``load`` (``checkpoint_id``, process groups) |
| `_full_state.py` | `gather_full` / `scatter_full`: full tensors on rank 0, and back into shards |
| `_state_dict_forms.py` | DCP's state-dict shapes: submodules, frozen parameters, several/flat optimizers |
| `_state_dict.py` | `get_model_state_dict` and the other state-dict helpers, `StateDictOptions` |
"""

from ._dcp_api import check_alone_state, checkpoint_path, dcp_scope, refuse_dcp_extensions
from ._flatten import Leaf, flatten, join_key, set_values, to_json_value
from ._full_state import gather_full, scatter_full
from ._state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict,
                          set_model_state_dict, set_optimizer_state_dict, set_state_dict)
from ._stateful import Stateful, expand_stateful

__all__ = ["Leaf", "StateDictOptions", "Stateful", "check_alone_state", "checkpoint_path", "dcp_scope",
           "expand_stateful", "flatten", "gather_full", "get_model_state_dict", "get_optimizer_state_dict",
           "get_state_dict", "join_key", "refuse_dcp_extensions", "scatter_full", "set_model_state_dict",
           "set_optimizer_state_dict", "set_state_dict", "set_values", "to_json_value"]
