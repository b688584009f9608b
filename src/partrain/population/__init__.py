"""Populations: many models of one architecture trained at once in one process, and PBT.

- `Population`: N members, each with its own seed, data order and hyperparameters;
  one ``step`` trains them all, with a vectorized (``vmap``) or a loop engine chosen
  by measuring both.
- `PBT`: population-based training (exploit the best, explore hyperparameters).
- `MemberLoader` / `train_population`: the loop ``partrain population`` runs.
- `space`: search-space distributions (`loguniform`, `uniform`, `randint`, `choice`).
"""

from .engines import MemberDropout
from .functional_optim import OPTIMIZERS, make_optimizer
from .pbt import PBT
from .population import Population, member_seed
from .space import choice, loguniform, randint, uniform
from .trainer import MemberLoader, train_population

__all__ = [
    "OPTIMIZERS",
    "PBT",
    "MemberDropout",
    "MemberLoader",
    "Population",
    "choice",
    "loguniform",
    "make_optimizer",
    "member_seed",
    "randint",
    "train_population",
    "uniform",
]
