"""Hugging Face folders: safetensors loaded into sharded state, and complete model folders written.

| module | one line |
| --- | --- |
| `_safetensors.py` | `load_safetensors`: a Hugging Face folder's tensors into (sharded) state; tied weights |
| `_config.py` | `HFConfig`: the config of a folder and the check of its tensors against it |
| `_moe.py` | expert names: a stacked expert tensor as the per-expert names of a Hugging Face folder |
| `_folder.py` | what goes into which weight file, index and config (`plan_folder`, `finish_folder`); `save_hf_folder` |
| `_save_pretrained.py` | `save_pretrained`: `save_hf_folder` with transformers' arguments |
"""

from ._folder import finish_folder, model_prefix, plan_folder, read_config, save_hf_folder
from ._safetensors import HF_INDEX_FILE, TENSORS_INDEX_FILE, load_safetensors
from ._save_pretrained import save_pretrained

__all__ = ["HF_INDEX_FILE", "TENSORS_INDEX_FILE", "finish_folder", "load_safetensors", "model_prefix", "plan_folder",
           "read_config", "save_hf_folder", "save_pretrained"]
