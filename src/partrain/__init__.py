"""partrain: train and serve PyTorch models in parallel with one training loop.

The user writes one loop; the way it runs on many processes is a strategy
named on the command line or passed to `launch` / `fit`.
"""

# ``partrain.compare`` is the function, bound here, eagerly: the subpackage's name would shadow it
from .compare import compare
from .env import DistEnv
from .errors import UsageError, WorkerError
from .launch import launch
from .pool import WorkerPool
from .strategies import Strategy, get_strategy

__version__ = "0.1.0"

__all__ = ["DistEnv", "FitConfig", "LaunchConfig", "RunResult", "Strategy", "UsageError", "WorkerError",
           "WorkerPool", "compare", "fit", "get_strategy", "launch"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: the training loop pulls in more modules
    if name == "fit":
        from .train.fit import fit

        return fit
    if name == "RunResult":
        from .train.result import RunResult

        return RunResult
    if name in ("FitConfig", "LaunchConfig"):
        from .train import config

        return getattr(config, name)
    raise AttributeError(name)
