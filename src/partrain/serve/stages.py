"""Serve a model split across processes: ``partrain serve MODEL --stages P``.

For a model too big for one process (or, with one device per stage, one device): the
server process runs the first stage and answers HTTP as usual; P - 1 stage processes
each hold one contiguous run of the model's top-level children (an ``nn.Sequential``,
cut where the parameters balance, as the `pipeline` training strategy cuts it). From a
``partrain train`` checkpoint, each process builds the model on the meta device (no
memory), cuts it and reads only its own run's weights from the checkpoint (mapped, not
copied): no process ever holds more than its part. From a ``module:factory`` (user code
that builds and loads the model), each process builds the whole model once and keeps its
own run of layers.

A batch the `Batcher` hands the model goes through in ``microbatches`` pieces: the
server computes piece j on its stage and sends it on without waiting, so stage 1
works on piece j while the server computes piece j + 1 (a forward-only GPipe). The
last stage sends each piece's output back to the server, which concatenates them.

Between processes every byte goes through ``torch.distributed`` (gloo point-to-point:
a small header with the dtype and shape, then the tensor). Nothing is pickled.
Failures are bounded: the server waits for a piece's output at most ``timeout``
seconds, a stage that dies breaks its connections at once (the server then answers
every request with the error naming the stage), stage processes stop when the server
stops or dies (`partrain._process.watch_parent`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from .._process import child_started, process_context, start_child, stop_processes
from ..errors import UsageError, error_line
from ..nn.split import chunk_ranges, plan_cuts, sequential_children

#: the wire: int64 header [kind, dtype, ndim, *shape padded to MAX_DIMS]
MAX_DIMS = 8
TENSOR, STOP = 1, 0
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]
#: how long a stage process may take to start and meet the server (import torch, load the model)
START_TIMEOUT = 300.0
#: the fewest rows of a piece (``--min-microbatch-rows``): a piece of fewer rows reads every weight
#: matrix of its stage for little arithmetic, so cutting a small batch into more pieces multiplies
#: the weight traffic instead of overlapping work. 2 GiB of Linear(8192) layers on 2 CPU cores, 16
#: clients: 4 pieces of 4 rows gave 0.45 of the unsplit server's req/s, 1 piece 0.75
MIN_PIECE_ROWS = 16
#: how long the server waits for one piece's output before the request fails
STEP_TIMEOUT = 120.0
#: the process group's own limit: a stage waits for the next request for as long as the server lives
IDLE = datetime.timedelta(days=3650)


# ----- the model's stages ------------------------------------------------------------------------

def module_of(source: str) -> nn.Module:
    """The ``nn.Module`` a MODEL argument gives (a ``partrain train`` checkpoint or module:factory),
    without its weights where it can (`own_part` reads a part's)."""
    from .loading import module_from_source, parse_model_arg

    return module_from_source(parse_model_arg(source)[1], weights=False)[0].eval()


def own_part(part: nn.Module, source: str) -> nn.Module:
    """``part`` of the model ``source`` gives, with its weights (read now when `module_of` left them out)."""
    from .checkpoints import materialize
    from .loading import parse_model_arg

    path = parse_model_arg(source)[1]
    return materialize(part, path) if os.path.isfile(path) else part


def cut(module: nn.Module, stages: int) -> tuple[list[nn.Sequential], nn.Module | None]:
    """``module``'s children in ``stages`` runs balanced by parameters, and the `Preprocess`
    wrapper around them if there is one (it runs on the first stage)."""
    from .checkpoints import Preprocess

    pre = None
    if isinstance(module, Preprocess):
        pre, module = module, module.model
    children = sequential_children(module, "partrain serve --stages")
    cuts = plan_cuts(children, stages, "params")
    chunks = [nn.Sequential(OrderedDict(children[i] for i in r)).eval()
              for r in chunk_ranges(cuts, len(children))]
    return chunks, pre


# ----- the wire -----------------------------------------------------------------------------------

def _header(t: torch.Tensor | None) -> torch.Tensor:
    h = torch.zeros(3 + MAX_DIMS, dtype=torch.int64)
    if t is None:
        h[0] = STOP
        return h
    if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
        raise UsageError(f"Expected a stage output of at most {MAX_DIMS} dims in {DTYPES}. "
                         f"Received: {t.dtype} of shape {tuple(t.shape)}")
    h[0], h[1], h[2] = TENSOR, DTYPES.index(t.dtype), t.dim()
    h[3:3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _empty_for(h: torch.Tensor) -> torch.Tensor:
    ndim = int(h[2])
    return torch.empty(tuple(int(d) for d in h[3:3 + ndim]), dtype=DTYPES[int(h[1])])


class _Sends:
    """Sends that have not completed yet (their tensors must live until they do)."""

    def __init__(self) -> None:
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, t: torch.Tensor, dst: int) -> None:
        t = t.contiguous()
        self.pending.append((dist.isend(t, dst), t))
        self.pending = [(w, x) for w, x in self.pending if not w.is_completed()]

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


# ----- the server's side: the first stage --------------------------------------------------------

class FirstStage(nn.Module):
    """The model as the server calls it: the first stage here, the rest in the stage processes."""

    def __init__(self, chunk: nn.Sequential, pre: nn.Module | None, stages: int, microbatches: int,
                 timeout: float = STEP_TIMEOUT, min_rows: int = MIN_PIECE_ROWS) -> None:
        super().__init__()
        self.chunk = chunk
        self.pre = pre
        self.stages, self.microbatches, self.timeout = stages, microbatches, timeout
        self.min_rows = min_rows
        self.lock = threading.Lock()  # one batch in the pipe at a time
        self.broken: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.broken is not None:
            raise RuntimeError(self.broken)
        if self.pre is not None:
            x = x * self.pre.scale + self.pre.offset if x.is_floating_point() else x
        pieces = x.tensor_split(max(1, min(self.microbatches, x.shape[0] // self.min_rows)))
        with self.lock, torch.no_grad():
            sends = _Sends()
            try:
                for piece in pieces:  # each piece goes on at once: stage 1 starts while this one computes
                    y = self.chunk(piece)
                    sends.send(_header(y), 1)
                    sends.send(y, 1)
                last = self.stages - 1
                outputs = [self._receive(last) for _ in pieces]
                sends.flush()
            except RuntimeError as exc:  # a stage died or timed out: every later request says so
                self.broken = f"the model's stages stopped answering ({error_line(exc)})"
                raise RuntimeError(self.broken) from None
        return torch.cat(outputs)

    def _receive(self, src: int) -> torch.Tensor:
        wait = datetime.timedelta(seconds=self.timeout)
        header = torch.empty(3 + MAX_DIMS, dtype=torch.int64)
        dist.irecv(header, src).wait(wait)
        out = _empty_for(header)
        dist.irecv(out, src).wait(wait)
        return out


# ----- a stage process ---------------------------------------------------------------------------

def _stage_main(rank: int, stages: int, store_dir: str, source: str, threads: int) -> None:
    child_started()  # Ctrl-C is the server's to handle; SIGTERM unwinds this process
    torch.set_num_threads(threads)
    store = dist.FileStore(os.path.join(store_dir, "store"), stages)
    comm.init_process_group("gloo", store=store, rank=rank, world_size=stages, timeout=IDLE.total_seconds())
    try:
        chunks, _ = cut(module_of(source), stages)
        chunk = own_part(chunks[rank], source)
        del chunks
        dst = rank + 1 if rank + 1 < stages else 0
        sends = _Sends()
        header = torch.empty(3 + MAX_DIMS, dtype=torch.int64)
        with torch.no_grad():
            while True:
                dist.recv(header, rank - 1)
                if int(header[0]) == STOP:
                    sends.flush()
                    if dst != 0:
                        dist.send(_header(None), dst)
                    return
                x = _empty_for(header)
                dist.recv(x, rank - 1)
                y = chunk(x)
                sends.send(_header(y), dst)
                sends.send(y, dst)
    except KeyboardInterrupt:  # SIGTERM from the server: it is stopping
        return
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        comm.forget_groups()


@contextlib.contextmanager
def stage_processes(source: str, stages: int, *, microbatches: int = 4, threads: int = 1,
                    start_timeout: float = START_TIMEOUT,
                    min_rows: int = MIN_PIECE_ROWS) -> Iterator[Callable[[nn.Module], nn.Module]]:
    """Start ``stages - 1`` stage processes for ``source``; yield what turns the server's copy of
    the model into its `FirstStage`. On exit the stages are told to stop, then stopped."""
    if stages < 2:
        raise UsageError(f"Expected --stages >= 2 to split a model. Received: {stages}")
    cut(module_of(source), stages)  # one line here for a model that cannot be cut, not in every stage
    store_dir = tempfile.mkdtemp(prefix="partrain-stages-")
    ctx = process_context()
    procs: list[Any] = []
    joined = False
    try:
        for r in range(1, stages):
            start_child(ctx, _stage_main, (r, stages, store_dir, source, threads), name=f"partrain-stage-{r}",
                        keep=procs.append, daemon=True)
        store = dist.FileStore(os.path.join(store_dir, "store"), stages)
        store.set_timeout(datetime.timedelta(seconds=start_timeout))
        try:
            comm.init_process_group("gloo", store=store, rank=0, world_size=stages, timeout=IDLE.total_seconds())
        except RuntimeError as exc:
            dead = [p.name for p in procs if not p.is_alive()]
            raise UsageError(f"Expected {stages - 1} stage process(es) to start within {start_timeout:g} s. "
                             f"Received: {', '.join(dead) + ' died' if dead else error_line(exc)}") from None
        joined = True

        def first_stage(module: nn.Module) -> nn.Module:
            chunks, pre = cut(module, stages)
            return FirstStage(own_part(chunks[0], source), pre, stages, microbatches, min_rows=min_rows)

        yield first_stage
        if all(p.is_alive() for p in procs):
            dist.send(_header(None), 1)  # stage by stage, each finishes what it holds and passes it on
            for p in procs:
                p.join(10.0)
    finally:
        stop_processes([p for p in procs if p.is_alive()], grace=5.0)
        if joined:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            comm.forget_groups()
        shutil.rmtree(store_dir, ignore_errors=True)
