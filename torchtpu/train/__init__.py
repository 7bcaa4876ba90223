"""The torchtpu trainer: configuration, training loop, data, checkpoints and metrics.

Only the configuration layer is imported here (it needs nothing beyond the standard library);
the other modules are imported where they are used.
"""

from .config.job_config import ConfigError, JobConfig  # noqa: F401
from .config.manager import load_config  # noqa: F401
from .parallel_dims import ParallelDims, resolve_dims  # noqa: F401
