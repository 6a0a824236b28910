"""Hugging Face folders: safetensors loaded into sharded state, and complete model folders written."""

from ._folder import finish_folder, model_prefix, plan_folder, read_config, save_hf_folder
from ._safetensors import HF_INDEX_FILE, TENSORS_INDEX_FILE, load_safetensors
from ._save_pretrained import save_pretrained

__all__ = ["HF_INDEX_FILE", "TENSORS_INDEX_FILE", "finish_folder", "load_safetensors", "model_prefix", "plan_folder",
           "read_config", "save_hf_folder", "save_pretrained"]
