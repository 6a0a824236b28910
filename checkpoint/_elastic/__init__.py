"""Elastic training: resuming on another world size and surviving a dead peer."""

from ._heartbeat import Heartbeat, HeartbeatPolicy, exit_for_restart, start_heartbeat
from ._loader import ElasticLoader
from ._sampler import BatchPlan, ElasticSampler, plan_batches
from ._training_state import TrainingSnapshot, async_save_training_state, load_training_state, save_training_state

__all__ = ["BatchPlan", "ElasticLoader", "ElasticSampler", "Heartbeat", "HeartbeatPolicy", "TrainingSnapshot",
           "async_save_training_state", "exit_for_restart", "load_training_state", "plan_batches",
           "save_training_state", "start_heartbeat"]
