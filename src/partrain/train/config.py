"""`fit`'s settings in two groups: how the loop trains (`FitConfig`) and where it runs (`LaunchConfig`).

Users can build either and pass it to `fit`, or name any field as a keyword
argument (``fit(..., epochs=5, workers=2)``): keywords override the objects'
fields. Every value is checked here, before a process starts, with one line
saying what was expected and what was received.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..data.pipeline import LoaderSettings
from ..env import DEFAULT_TIMEOUT
from ..errors import UsageError
from ..launch import check_arguments
from .schedule import parse_schedule
from .task import PRECISIONS

ON_NAN = ("stop", "skip", "off")

if TYPE_CHECKING:
    from ..pool import WorkerPool


@dataclass
class FitConfig:
    """How the loop trains and what it writes (picklable: it travels to the workers).

    Batch size is **per worker**: with ``batch_size=32`` and 4 workers an optimizer
    step sees 128 samples (times ``accumulate`` micro-batches).
    """

    epochs: int = 1
    batch_size: int = 32
    eval_batch_size: int = 512
    #: micro-batches per optimizer step; the inner ones skip gradient communication
    accumulate: int = 1
    #: linear scaling rule: ``lr * workers * accumulate``
    scale_lr: bool = False
    seed: int = 0
    #: stop after this many optimizer steps in total (None: run every epoch)
    max_steps: int | None = None
    #: stop at the end of the epoch that ends nearest this many seconds of training (the
    #: workers' mean; evaluations and checkpoints not counted), all workers in the same epoch;
    #: with ``epochs`` as the most (None: no time limit)
    max_seconds: float | None = None
    #: an epoch of this many training samples, each epoch going on through the shuffled training
    #: set where the last one stopped (evaluate, checkpoint and log every N samples of a large
    #: training set; Keras's ``steps_per_epoch`` on a repeated dataset); None: the whole set
    samples_per_epoch: int | None = None
    drop_last: bool = False
    #: where metrics, curves and checkpoints go (nothing is written without it)
    out_dir: str | None = None
    #: a checkpoint to continue from; ``"auto"``: ``out_dir/checkpoint.pt`` (or ``checkpoint.dcp``,
    #: a sharded one) if it exists, whichever went further
    resume: str | None = None
    checkpoint: bool = True
    #: a sharded checkpoint (``fsdp``, ``tp``) is written in the background while training goes on;
    #: the next checkpoint or the run's end waits for it
    checkpoint_async: bool = False
    #: also checkpoint within an epoch, every this many optimizer steps (exact resume from there)
    checkpoint_every: int | None = None
    #: also checkpoint within an epoch when this many seconds have passed since the last one
    checkpoint_seconds: float | None = None
    quiet: bool = False
    #: a progress bar; None: when stderr is a terminal
    progress: bool | None = None
    #: put the final model ``state_dict`` in the result (`RunResult.model()` rebuilds the model)
    return_state: bool = True
    #: how ``partrain serve`` rebuilds the model from the checkpoint (name, kwargs, input shape);
    #: None: recorded from ``model_fn`` when it is an importable ``module:function``
    model_spec: dict[str, Any] | None = None
    #: a non-finite loss or gradient: ``stop`` the run (before a checkpoint is written),
    #: ``skip`` the step (its gradient is dropped and counted), or ``off`` (no check)
    on_nan: str = "stop"
    #: clip the gradient's global L2 norm to this value before each step
    clip_grad: float | None = None
    #: ``fp32`` or ``bf16`` (autocast of the forward pass)
    precision: str = "fp32"
    #: ``constant``, ``cosine``, ``linear`` or ``step:EPOCHS[:GAMMA]``, per optimizer step
    lr_schedule: str | None = None
    #: linear warm-up of the learning rate over this many optimizer steps
    warmup_steps: int = 0
    #: stop when ``monitor`` has not improved for this many epochs
    early_stop: int | None = None
    #: the figure early stopping and ``best.pt`` follow; None: ``test_loss`` (``train_loss``
    #: without a test set); losses and errors are minimised, accuracy maximised
    monitor: str | None = None
    #: TensorBoard event files in ``out_dir/tensorboard`` (needs the ``tensorboard`` package)
    tensorboard: bool = False
    #: replace the files of a run already in ``out_dir`` (otherwise that is an error)
    overwrite: bool = False
    #: extra settings written to config.json (the CLI's arguments, to repeat a run)
    extra_config: dict[str, Any] | None = None
    #: how batches are loaded (`partrain.data.pipeline`): ``auto`` (in-memory tensors inline,
    #: other datasets by loader threads, more threads when the loop waits for data), ``inline``,
    #: ``threads`` (I/O-bound readers) or ``processes`` (CPU-bound decoding)
    loader: str = "auto"
    #: loader threads or processes per worker (None: 2, or what ``auto`` tunes)
    loader_workers: int | None = None
    #: batches in flight per loader thread or process
    prefetch: int = 2
    #: seconds to wait for one batch before a loader counts as stuck
    loader_timeout: float = 300.0
    #: copy the training set to the device once; batches are gathers there (an in-memory TensorDataset)
    data_on_device: bool = False
    #: ``torch.compile`` the model: True (inductor; CUDA graphs on CUDA) or a backend name
    compile: bool | str = False
    #: batch samples of similar length together (`partrain.data.BucketBatchSampler`); needs a
    #: training set with ``lengths`` (`partrain.data.Sequences`); None: when it has them
    bucket: bool | None = None
    #: recompute activations in the backward pass (`partrain.nn.checkpointing`): True for the
    #: model's repeated blocks, or a block class name (or a list of them)
    activation_checkpointing: bool | str | list[str] = False

    def loader_settings(self) -> LoaderSettings:
        return LoaderSettings(self.loader, self.loader_workers, self.prefetch, self.loader_timeout)

    def validate(self) -> None:
        _positive("epochs", self.epochs, "number of epochs")
        _positive("batch_size", self.batch_size, "batch size")
        _positive("eval_batch_size", self.eval_batch_size, "evaluation batch size")
        _positive("accumulate", self.accumulate, "number of micro-batches to accumulate")
        spec = self.activation_checkpointing
        if not (isinstance(spec, (bool, str)) or isinstance(spec, (list, tuple)) and all(isinstance(s, str) for s in spec)):
            raise UsageError("Expected activation_checkpointing to be True/False, a block class name or a list of them. "
                             f"Received: {spec!r}")
        if self.max_steps is not None:
            _positive("max_steps", self.max_steps, "number of steps")
        _seconds_or_none("max_seconds", self.max_seconds)
        if self.samples_per_epoch is not None:
            _positive("samples_per_epoch", self.samples_per_epoch, "number of training samples per epoch")
        if self.out_dir is not None and not str(self.out_dir).strip():
            raise UsageError("Expected out_dir to be a directory path or None. Received: an empty string")
        if self.on_nan not in ON_NAN:
            raise UsageError(f"Expected on_nan among {list(ON_NAN)}. Received: {self.on_nan!r}")
        if self.clip_grad is not None and not (isinstance(self.clip_grad, (int, float)) and self.clip_grad > 0
                                               and math.isfinite(self.clip_grad)):
            raise UsageError(f"Expected clip_grad to be a positive number or None. Received: {self.clip_grad!r}")
        if self.precision not in PRECISIONS:
            raise UsageError(f"Expected precision among {list(PRECISIONS)}. Received: {self.precision!r}")
        parse_schedule(self.lr_schedule, self.warmup_steps)
        if self.checkpoint_every is not None:
            _positive("checkpoint_every", self.checkpoint_every, "number of steps between checkpoints")
        _seconds_or_none("checkpoint_seconds", self.checkpoint_seconds)
        if self.early_stop is not None:
            _positive("early_stop", self.early_stop, "number of epochs without improvement")
        self.loader_settings().validate()
        if not isinstance(self.compile, (bool, str)):
            raise UsageError(f"Expected compile to be True, False or a torch.compile backend name. "
                             f"Received: {self.compile!r}")


@dataclass
class LaunchConfig:
    """Where the workers run: passed to `partrain.launch` (see it for each field)."""

    workers: int = 1
    #: seconds for rendezvous, every collective and every queue wait
    timeout: float = DEFAULT_TIMEOUT
    backend: str | None = None
    device: str | None = None
    #: intra-op threads per process; None: the available cores divided among the processes
    threads: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    #: processes kept between runs (`partrain.WorkerPool`); None: the enclosing pool or fresh ones
    pool: WorkerPool | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as `partrain.launch` keywords (shallow: the pool is not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def validate(self) -> None:
        check_arguments(self.workers, self.timeout, self.threads, device=self.device, backend=self.backend)


def split_options(config: FitConfig | None, launch_config: LaunchConfig | None,
                  options: dict[str, Any]) -> tuple[FitConfig, LaunchConfig]:
    """``fit``'s keyword options applied over the two config objects (defaults when None)."""
    fit_names = {f.name for f in dataclasses.fields(FitConfig)}
    launch_names = {f.name for f in dataclasses.fields(LaunchConfig)}
    unknown = sorted(set(options) - fit_names - launch_names)
    if unknown:
        raise UsageError(f"Expected fit options among {sorted(fit_names | launch_names)}. "
                         f"Received: {', '.join(unknown)}")
    for name, value, cls in (("config", config, FitConfig), ("launch_config", launch_config, LaunchConfig)):
        if value is not None and not isinstance(value, cls):
            raise UsageError(f"Expected {name} to be a {cls.__name__} or None. Received: {type(value).__name__}")
    cfg = dataclasses.replace(config or FitConfig(), **{k: v for k, v in options.items() if k in fit_names})
    launch_cfg = dataclasses.replace(launch_config or LaunchConfig(),
                                     **{k: v for k, v in options.items() if k in launch_names})
    cfg.validate()
    launch_cfg.validate()
    return cfg, launch_cfg


def _seconds_or_none(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value <= 0):
        raise UsageError(f"Expected {name} to be a positive number of seconds or None. Received: {value!r}")


def _positive(name: str, value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"Expected a positive {what}. Received: {name}={value!r}")
