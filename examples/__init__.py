"""Runnable examples for shardwise: a small Llama-style model, synthetic data and a training script."""
