"""Settings shared by the coordinator and the workers: CLI flags, model config, errors.

Imports neither `lorad.daemon` nor `lorad.workers`, and no torch.
"""

from lorad.config.errors import ConfigError
from lorad.config.model import ModelConfig, RopeScaling
from lorad.config.serve import ServeConfig, WorkerConfig

__all__ = ["ConfigError", "ModelConfig", "RopeScaling", "ServeConfig", "WorkerConfig"]
