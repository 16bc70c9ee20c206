"""shardrun: sharded NeMo Gym rollout collection and reward profiling on Slurm or locally."""

__version__ = "0.1.0"
