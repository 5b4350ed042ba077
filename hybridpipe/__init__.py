"""hybridpipe: pipelined hybrid-parallel training for PyTorch.

The user's path is profile -> partition -> launch (see README.md). Packages import
one way: profiles -> partitioner -> comm -> pipeline -> runtime -> cli / launch.py.
"""

__version__ = "0.1.0"

__all__ = ["Trainer", "TrainingConfig", "lr_schedule"]


def __getattr__(name: str):
    """``hybridpipe.Trainer`` (runtime/trainer.py), ``hybridpipe.TrainingConfig``
    (runtime/training_config.py) and ``hybridpipe.lr_schedule`` (runtime/lr.py), imported on first
    use so that ``import hybridpipe`` stays light."""
    if name == "Trainer":
        from hybridpipe.runtime.trainer import Trainer
        return Trainer
    if name == "TrainingConfig":
        from hybridpipe.runtime.training_config import TrainingConfig
        return TrainingConfig
    if name == "lr_schedule":
        from hybridpipe.runtime.lr import lr_schedule
        return lr_schedule
    raise AttributeError(f"module 'hybridpipe' has no attribute {name!r}")
