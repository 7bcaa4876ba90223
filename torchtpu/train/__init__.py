"""The torchtpu trainer: configuration, training loop, data, checkpoints and metrics.

Only the configuration layer is imported here (it needs nothing beyond the standard library);
the other modules are imported where they are used.
"""
from .config import ConfigError, JobConfig, ParallelDims, load_config, validate  # noqa: F401
