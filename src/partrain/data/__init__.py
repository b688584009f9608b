"""Data: datasets by name, per-worker sharding, input pipelines, length bucketing, padding."""

from .bucketing import BucketBatchSampler
from .datasets import DataSpec, load_dataset, load_digits, load_npz, synthetic
from .generated import Generated
from .padding import (
           PadCollate,
           Sequences,
           TokenCollate,
           mask_of,
           pack,
           pad_cat,
           pad_collate,
           pad_sequences,
)
from .pipeline import LOADERS, Feeder, LoaderError, LoaderSettings
from .sharding import ShardedBatchSampler
from .sources import HDF5Dataset, NpyArrays

__all__ = ["LOADERS", "BucketBatchSampler", "DataSpec", "Feeder", "Generated", "HDF5Dataset", "LoaderError", "LoaderSettings",
           "NpyArrays", "PadCollate", "Sequences", "TokenCollate", "ShardedBatchSampler", "load_dataset", "load_digits",
           "load_npz", "mask_of", "pack", "pad_cat", "pad_collate", "pad_sequences", "synthetic"]
