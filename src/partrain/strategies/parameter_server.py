"""``ps``: a sharded parameter server - synchronous, bounded-staleness or asynchronous.

K server processes (the first K ranks) each own a shard of the parameters,
balanced by size, and run the optimizer for that shard; N workers compute
gradients. The user's loop does not change: `prepare` returns the model and
an optimizer *proxy* (a real `torch.optim.Optimizer` over the same parameter
groups, so LR schedulers work) whose ``step()`` pushes the gradients, with the
current hyperparameters of every group, to the servers and asks for the new
parameters. The servers rebuild the worker's optimizer class with the same
hyperparameters over their shard (class path and JSON, never pickle).

One knob, ``staleness``:

- ``0`` - synchronous: a server averages one gradient per live worker per
  version and applies it once; equal to all-reduce SGD on the global batch.
  ``backup_workers=b`` applies once N-b gradients arrived; late ones are
  dropped and counted.
- ``s > 0`` - bounded staleness: gradients are applied as they arrive; a
  worker may be at most ``s`` steps ahead of the slowest live worker, else it
  blocks.
- ``inf`` - fully asynchronous.

Where a worker blocks: ``optimizer.step()`` only *posts* the push and the
receive of the next parameters, then returns; the wait happens at the next
forward pass of the model (a forward pre-hook), so loading the next batch
overlaps with the round trip and, in sync mode, with the slowest worker.
`model_state_dict`, `state_dict`, `metrics`, `close` and the next ``step()``
also complete an outstanding pull first. ``comm_seconds`` counts only those
waits. ``overlap=True`` (staleness > 0 only) does not wait at the forward pass: a
training step computes on the parameters it has while the reply to the previous
push is still in flight, and that reply is loaded at the next ``step()`` (before
the push). The round trip and the server's update then overlap a whole forward
and backward, at the price of one more update of staleness per gradient (with
one worker: SGD on the gradient of the parameters one step back). Evaluation
(a forward in eval mode) still waits. ``staleness_lr=True`` divides a gradient's
learning rate by its staleness (updates the shard received between the pull the gradient was
computed on and this one; at least 1).

``colocate=True`` (for machines with no cores to spare for server processes): no
server processes; every worker process also runs one server, a thread, which
owns the shard of its index (as many shards as workers). A worker's messages to
the server in its own process go through an in-process pipe; those to the
others through gloo, as usual. A colocated job cannot survive a dead worker
(its shard dies with it), so every mode then treats a lost worker as an error.
``comm_bytes`` counts the bytes that leave the process.

Wire (see `_ps_wire`): a push is one message per server (header, hyperparameters
and the gradient in one buffer, filled in place) and the reply one message
(header and parameters: the server's parameters live in its reply buffer).

Frozen elements (`partrain.nn.freeze`): the servers run the optimizer, so worker
0's hello carries each shard's frozen masks (JSON indices and a uint8 tensor)
and every server attaches `keep_frozen` to its optimizer: frozen elements and
their optimizer state come back from every update bit-for-bit unchanged.

In bounded and async modes a dead worker does not stop training (servers and
the launcher carry on; the workers' ``all_reduce_sum``/``barrier`` then go
through server 0 so they skip it); in sync mode it is an error naming it. A
server that dies is an error naming it on every worker waiting on it.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from .. import comm
from ..env import DEFAULT_TIMEOUT, DistEnv
from ..errors import UsageError
from ..nn.freeze import frozen_mask
from . import _ps_wire as wire
from ._ps_server import Server
from .base import WORKER, Strategy, register

SERVER = "server"


@register
class ParameterServer(Strategy):
    """Sharded parameter server. See the module docstring."""

    name = "ps"

    @classmethod
    def optimizer_state_in(cls, state: Any, numels: list[int]) -> dict[int, dict[str, Any]] | None:
        """The optimizer state this strategy's checkpoint keeps on its servers (`ps_optimizer_states`)."""
        return ps_optimizer_states(state, numels) if is_ps_state(state) else None

    def __init__(self, servers: int = 1, staleness: float = 0, backup_workers: int = 0,
                 staleness_lr: bool = False, overlap: bool = False, colocate: bool = False) -> None:
        super().__init__()
        if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
            raise UsageError(f"Expected a positive number of servers. Received: servers={servers!r}")
        if isinstance(staleness, bool) or not isinstance(staleness, (int, float)) or math.isnan(staleness) \
                or staleness < 0:
            raise UsageError(f"Expected staleness >= 0 (0 sync, inf async). Received: staleness={staleness!r}")
        if isinstance(backup_workers, bool) or not isinstance(backup_workers, int) or backup_workers < 0:
            raise UsageError(f"Expected backup_workers >= 0. Received: backup_workers={backup_workers!r}")
        if backup_workers and staleness != 0:
            raise UsageError(f"Expected backup_workers only in sync mode (staleness=0). Received: "
                             f"backup_workers={backup_workers}, staleness={staleness}")
        if not isinstance(overlap, bool):
            raise UsageError(f"Expected overlap=true or false. Received: overlap={overlap!r}")
        if not isinstance(colocate, bool):
            raise UsageError(f"Expected colocate=true or false. Received: colocate={colocate!r}")
        if overlap and staleness == 0:
            raise UsageError("Expected overlap only with staleness > 0 (it computes on parameters one update "
                             "older). Received: overlap=True, staleness=0")
        self.servers = servers
        self.colocate = colocate
        self.staleness = staleness
        self.overlap = overlap
        self.backup_workers = backup_workers
        self.staleness_lr = bool(staleness_lr)
        #: bounded and async modes go on without a worker that died (not colocated: its shard dies too)
        self.survives_worker_loss = staleness > 0 and not colocate  # type: ignore[misc]
        #: async mode: workers claim batches, so a fast worker takes more of each epoch. Not in
        #: bounded mode: a worker past its share would wait on one already done with the epoch.
        self.dynamic_sharding = math.isinf(staleness)  # type: ignore[misc]
        self.server_ranks: list[int] = []
        self._pg: Any = None  # gloo group for the servers' traffic (None: the default group)
        self._model: nn.Module | None = None
        self._params: list[torch.Tensor] = []
        self._plan: list[list[int]] = []
        self._dtype = torch.float32
        self._hp_slots: list[tuple[int, str, int | None, bool]] = []
        self._optimizer: _ServerOptimizer | None = None
        self._versions: list[int] = []
        self._pending: list[tuple[torch.Tensor, torch.Tensor, list[Any]]] | None = None
        self._pending_push = False
        self._sends: list[Any] = []
        self._reductions = 0
        self._closed = False
        #: per pushed gradient, from server 0's reply: (staleness, applied 1/dropped 0, lead)
        self.trace: list[tuple[int, int, int]] = []
        self._staleness = Counter[int]()
        self._dropped = 0
        self._bytes_pulled = 0
        self._reply_frames: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per server: buf, head, flat
        # colocated: the server thread of this process and the pipes to it (requests, replies)
        self._local_server: int | None = None
        self._pipes: tuple[wire.LocalPipe, wire.LocalPipe] | None = None
        self._server_thread: threading.Thread | None = None
        self._server_error: str | None = None

    # ----- topology ------------------------------------------------------------------------------
    def extra_processes(self, workers: int) -> int:
        return 0 if self.colocate else self.servers

    def roles(self, world_size: int) -> list[str]:
        if self.colocate:
            return [WORKER] * world_size
        k = min(self.servers, world_size)
        return [SERVER] * k + [WORKER] * (world_size - k)

    def setup(self, env: DistEnv, *, store: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not comm.is_distributed() and not (self.colocate and env.world_size == 1):
            # (colocated with one worker: the server is a thread of this process, no group needed)
            raise UsageError("Expected the ps strategy to run under partrain.launch or torchrun. Received: no "
                             "process group (one process)")
        super().setup(env, store=store, timeout=timeout)
        if self.colocate:  # one server per worker process, server s in worker s's process
            if self.servers not in (1, self.num_workers):
                raise UsageError(f"Expected servers=1 (the default) or the number of workers with colocate=true "
                                 f"(one server per worker). Received: servers={self.servers}, "
                                 f"workers={self.num_workers}")
            self.servers = self.num_workers
            self.server_ranks = list(self.worker_ranks)
        else:
            self.server_ranks = list(range(self.servers))
        if self.backup_workers >= self.num_workers:
            raise UsageError(f"Expected backup_workers < workers. Received: backup_workers={self.backup_workers}, "
                             f"workers={self.num_workers}")
        if comm.is_distributed() and (env.backend != "gloo" or self.colocate):
            # the servers speak gloo, on CPU (e.g. beside NCCL workers); colocated, their traffic gets a
            # group of its own, apart from the collectives the worker threads run on the default group
            self._pg = comm.new_group(range(env.world_size), backend="gloo", timeout=timeout)

    def run_role(self, role: str) -> Any:
        if role != SERVER:
            return super().run_role(role)
        server = Server(index=self.env.rank, worker_ranks=self.worker_ranks, group=self._pg,
                        staleness=self.staleness, backup_workers=self.backup_workers,
                        staleness_lr=self.staleness_lr, timeout=self.timeout)
        return server.run()

    # ----- the training loop's side -----------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Optimizer) -> tuple[nn.Module, Optimizer]:
        if self._model is not None:
            raise UsageError("Expected prepare() once per ps strategy. Received: a second call")
        model = model.to(self.device)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        groups_of = [g for g, group in enumerate(optimizer.param_groups) for _ in group["params"]]
        if not params:
            raise UsageError("Expected an optimizer with parameters. Received: none")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise UsageError(f"Expected parameters of one floating dtype for the ps strategy. Received: "
                             f"{sorted(str(d) for d in dtypes)}")
        self._dtype = params[0].dtype
        self._params = params
        self._plan = wire.plan_shards([p.numel() for p in params], self.servers)
        opt_meta, self._hp_slots = _describe_optimizer(optimizer)
        self._optimizer = _ServerOptimizer(self, optimizer)
        self._model = model
        self._versions = [0] * self.servers
        for owned in self._plan:
            numel = sum(params[i].numel() for i in owned)
            buf, (flat,) = wire.frame(wire.header(0), [(numel, self._dtype)])
            self._reply_frames.append((buf, buf[:wire.HEADER_BYTES].view(torch.float64), flat))
        if self.colocate:
            self._start_server()
        # hello: worker 0 brings the initial parameters and the frozen masks, every worker then pulls them
        replies = self._post_replies()
        for s, owned in enumerate(self._plan):
            shard = [params[i] for i in owned]
            masks = {j: m for j, p in enumerate(shard) if (m := frozen_mask(p)) is not None and bool(m.any())}
            meta = {"shapes": [list(p.shape) for p in shard], "groups_of": [groups_of[i] for i in owned],
                    "dtype": wire.dtype_name(self._dtype), "numel": sum(p.numel() for p in shard),
                    "optimizer": opt_meta, "hp_slots": self._hp_slots, "frozen": sorted(masks),
                    "frozen_numel": sum(m.numel() for m in masks.values())}
            payload = wire.encode_json(meta)
            tensors = [wire.header(wire.HELLO, 0, 0, 0, payload.numel(), 1 if self.rank == 0 else 0), payload]
            if self.rank == 0:
                tensors.append(self._flat(shard, grads=False))
                if masks:
                    tensors.append(wire.flat_masks([masks[j] for j in sorted(masks)]))
            self._isend(s, tensors)
        self._pending = replies
        self._finish_pull()
        model.register_forward_pre_hook(self._before_forward)
        return model, self._optimizer

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        # overlap: a training forward goes on with the parameters it has; the pull in flight
        # (the reply to the last push) lands at the next step(), so the round trip and the
        # server's update overlap this step's forward and backward (one update more stale)
        if not (self.overlap and module.training):
            self._finish_pull()

    # ----- colocated server ---------------------------------------------------------------------
    def _start_server(self) -> None:
        """Colocated: run server ``self.rank`` in a thread of this process."""
        me = self.rank
        self._local_server = me
        requests = wire.LocalPipe(f"ps worker {me} -> the server in its process")
        replies = wire.LocalPipe(f"parameter server {me} (a thread of worker {me}) -> its worker")
        self._pipes = (requests, replies)
        server = Server(index=me, worker_ranks=self.worker_ranks, group=self._pg, staleness=self.staleness,
                        backup_workers=self.backup_workers, staleness_lr=self.staleness_lr, timeout=self.timeout,
                        local={me: (requests, replies)})

        def serve() -> None:
            try:
                server.run()
            except BaseException as exc:  # noqa: BLE001 - handed to the worker, whose waits then fail
                self._server_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                replies.failed = f"the server thread failed: {self._server_error}"
                print(f"partrain: error: parameter server {me} (a thread of worker rank {self.env.rank}): "
                      f"{self._server_error}", file=sys.stderr, flush=True)

        self._server_thread = threading.Thread(target=serve, daemon=True, name=f"ps-server-{me}")
        self._server_thread.start()

    # ----- messages -------------------------------------------------------------------------------
    def _isend(self, s: int, tensors: list[torch.Tensor]) -> None:
        if s == self._local_server:
            assert self._pipes is not None
            self._sends.extend(self._pipes[0].isend(t) for t in tensors)
            return
        self._sends.extend(wire.isend_tensors(tensors, self.server_ranks[s], self._pg))
        self.comm_bytes += sum(wire.nbytes(t) for t in tensors)

    def _irecv(self, s: int, t: torch.Tensor) -> Any:
        """Post the receive of server ``s``'s next reply part into ``t``."""
        if s == self._local_server:
            assert self._pipes is not None
            return self._pipes[1].irecv(t)
        return dist.irecv(t, self.server_ranks[s], group=self._pg, tag=wire.TAG_REPLY)

    def _post_replies(self) -> list[tuple[torch.Tensor, torch.Tensor, list[Any]]]:
        """Post the receives of every server's next parameters (before sending the request).

        Into one reply frame per server, reused: at most one pull is in flight."""
        return [(head, flat, [self._irecv(s, buf)]) for s, (buf, head, flat) in enumerate(self._reply_frames)]

    def _wait(self, work: Any, s: int, what: str) -> None:
        try:
            work.wait(wire.seconds(self.timeout))
        except Exception as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            hint = "" if math.isinf(self.staleness) else (
                " (in sync and bounded modes a server holds a reply back for the slowest live worker)")
            raise RuntimeError(f"parameter server {s} (rank {self.server_ranks[s]}) did not {what} within "
                               f"{self.timeout:g} s{hint}: {why}") from None

    def _wait_sends(self) -> None:
        sends, self._sends = self._sends, []
        for work in sends:
            try:
                work.wait(wire.seconds(self.timeout))
            except Exception as exc:
                raise RuntimeError(f"parameter server did not take a message within {self.timeout:g} s: "
                                   f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None

    def _finish_pull(self) -> None:
        """Wait for the outstanding pull (if any) and load the parameters into the model."""
        if self._pending is None:
            return
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        self._wait_sends()
        for s, (head, flat, works) in enumerate(pending):
            for work in works:
                self._wait(work, s, "send parameters")
            self._versions[s] = int(head[1])
            self._bytes_pulled += wire.nbytes(flat)
            if s == 0 and self._pending_push:
                tau, applied, lead = int(head[2]), int(head[3]), int(head[4])
                self.trace.append((tau, applied, lead))
                if applied:
                    self._staleness[tau] += 1
                else:
                    self._dropped += 1
            with torch.no_grad():
                comm.unflatten_into(flat, [self._params[i] for i in self._plan[s]])
        self._pending_push = False
        self.comm_seconds += time.perf_counter() - t0

    def push(self) -> None:
        """The proxy optimizer's ``step()``: send gradients, post the receive of the next parameters."""
        self._check_open()
        self._finish_pull()
        assert self._optimizer is not None
        hp = _hp_values(self._optimizer.param_groups, self._hp_slots)
        replies = self._post_replies()
        for s, owned in enumerate(self._plan):
            numel = self._reply_frames[s][2].numel()
            buf, (hp_part, grad_part) = wire.frame(wire.header(wire.PUSH, self._versions[s], hp.numel(), numel),
                                                   [(hp.numel(), torch.float64), (numel, self._dtype)])
            hp_part.copy_(hp)
            self._flat_into(grad_part, [self._params[i] for i in owned])
            self._isend(s, [buf])  # one message: header, hyperparameters, gradient
        self._pending = replies
        self._pending_push = True

    def pull(self) -> None:
        """Fetch the servers' current parameters into the model now."""
        self._check_open()
        self._finish_pull()
        replies = self._post_replies()
        for s in range(self.servers):
            self._isend(s, [wire.header(wire.PULL)])
        self._pending = replies
        self._finish_pull()

    def _request_json(self, s: int, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """Send a request to server ``s``; its reply is a header and a JSON payload."""
        head = torch.empty(wire.HEADER, dtype=torch.float64)
        recv = self._post_raw([head], s)
        self._isend(s, tensors)
        self._wait_sends()
        self._wait(recv[0], s, "answer")
        payload = torch.empty(int(head[4]), dtype=torch.uint8)
        self._wait(self._post_raw([payload], s)[0], s, "answer")
        return head, wire.decode_json(payload)

    def _flat_into(self, out: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """The gradients of ``tensors`` (zeros where none) written into the flat ``out``."""
        if not tensors:
            return
        parts = [(torch.zeros_like(p) if p.grad is None else p.grad).detach().reshape(-1) for p in tensors]
        if all(t.device.type == "cpu" and t.dtype == out.dtype for t in parts):
            torch.cat(parts, out=out)  # straight into the message
        else:
            out.copy_(torch.cat(parts))

    def _flat(self, tensors: list[torch.Tensor], grads: bool) -> torch.Tensor:
        parts = []
        for p in tensors:
            t = p.grad if grads else p
            parts.append((torch.zeros_like(p) if t is None else t).detach().reshape(-1))
        if not parts:
            return torch.empty(0, dtype=self._dtype)
        return torch.cat(parts).to("cpu", self._dtype)

    def _check_open(self) -> None:
        if self._model is None:
            raise UsageError("Expected strategy.prepare(model, optimizer) before training. Received: no prepare")
        if self._closed:
            raise UsageError("Expected an open ps strategy. Received: a step after close()")

    # ----- what the loop reads --------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The servers' current parameters, with this worker's buffers (e.g. BatchNorm statistics)."""
        if self._model is not None and not self._closed:
            self.pull()
        return self.unwrap(model).state_dict()

    def metrics(self) -> dict[str, float]:
        """Staleness histogram per worker, updates/s per server, bytes, dropped gradients, lost workers."""
        out: dict[str, float] = {"bytes_pushed": float(self.comm_bytes), "bytes_pulled": float(self._bytes_pulled)}
        if self._model is None or self._closed:
            return out
        self._finish_pull()
        for s in range(self.servers):
            _, st = self._request_json(s, [wire.header(wire.STATS)])
            out[f"server{s}_updates_per_s"] = st["updates_per_s"]
            out[f"server{s}_version"] = float(st["version"])
            out[f"server{s}_bytes_in"] = float(st["bytes_in"])
            out[f"server{s}_bytes_out"] = float(st["bytes_out"])
            if s == 0:
                out["dropped"] = float(sum(st["dropped"]))
                out["dead_workers"] = float(len(st["dead_workers"]))
                all_taus: Counter[int] = Counter()
                for w, hist in enumerate(st["staleness_hist"]):
                    h = Counter({int(k): v for k, v in hist.items()})
                    all_taus.update(h)
                    n = sum(h.values())
                    out[f"worker{w}_staleness_mean"] = sum(k * v for k, v in h.items()) / n if n else 0.0
                    out[f"worker{w}_staleness_max"] = float(max(h, default=0))
                    out[f"worker{w}_dropped"] = float(st["dropped"][w])
                    out[f"worker{w}_max_lead"] = float(st["max_lead"][w])
                    for k, v in sorted(h.items()):
                        out[f"worker{w}_staleness_hist_{k}"] = float(v)
                n = sum(all_taus.values())
                out["staleness_mean"] = sum(k * v for k, v in all_taus.items()) / n if n else 0.0
                out["staleness_max"] = float(max(all_taus, default=0))
        return out

    # ----- collectives over the workers -----------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the workers; through server 0 in bounded/async modes so a dead worker is skipped."""
        if not self.survives_worker_loss or self._model is None or self._closed:
            return super().all_reduce_sum(tensor)
        self._finish_pull()
        self._reductions += 1
        data = tensor.detach().to("cpu", torch.float64).reshape(-1).clone()
        result = torch.empty_like(data)
        recv = self._post_raw([torch.empty(wire.HEADER, dtype=torch.float64), result])
        self._isend(0, [wire.header(wire.REDUCE, self._reductions, data.numel()), data])
        self._wait_sends()
        for work in recv:
            self._wait(work, 0, "reduce")
        with torch.no_grad():
            tensor.copy_(result.view_as(tensor).to(tensor.dtype))
        return tensor

    def barrier(self) -> None:
        if not self.survives_worker_loss or self._model is None or self._closed:
            return super().barrier()
        self.all_reduce_sum(torch.zeros(1))

    def _post_raw(self, tensors: list[torch.Tensor], s: int = 0) -> list[Any]:
        return [self._irecv(s, t) for t in tensors]

    # ----- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every server's parameters, optimizer state, version and counters (gathered on worker 0)."""
        if self.rank != 0 or self._model is None or self._closed:
            return {}
        self._finish_pull()
        shards = []
        for s in range(self.servers):
            head = torch.empty(wire.HEADER, dtype=torch.float64)
            recv = self._post_raw([head], s)
            self._isend(s, [wire.header(wire.STATE_GET)])
            self._wait_sends()
            self._wait(recv[0], s, "send its state")
            payload = torch.empty(int(head[4]), dtype=torch.uint8)
            self._wait(self._post_raw([payload], s)[0], s, "send its state")
            meta = wire.decode_json(payload)
            tensors = wire.recv_described(meta["tensors"], functools.partial(self._irecv, s), self.timeout)
            shards.append({"meta": payload.numpy().tobytes().decode(), "tensors": tensors})
        # plan: which parameters (in the optimizer's order) each server holds, for another
        # strategy resuming from this checkpoint (`ps_optimizer_states`)
        return {"format": STATE_FORMAT, "servers": shards, "plan": self._plan}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the servers' state (worker 0 sends it), then every worker pulls the parameters."""
        if not state:
            return
        self._check_open()
        shards = state.get("servers")
        if not is_ps_state(state):
            raise UsageError(f"Expected a ps strategy state (format {STATE_FORMAT}). Received: "
                             f"{state.get('format')!r}")
        if len(shards) != self.servers:  # sharded otherwise: the optimizer state, parameter by parameter
            self.adopt_optimizer_state({"state": ps_optimizer_states(state, [p.numel() for p in self._params])})
            return
        self._set_server_states([(shard["meta"], list(shard["tensors"])) for shard in shards])

    def adopt_optimizer_state(self, state: dict[str, Any] | None) -> None:
        """Another strategy's checkpoint: the servers take its optimizer state (momentum, Adam's
        moments) for the parameters each holds, with the parameters the workers resumed."""
        self._check_open()
        per_param = (state or {}).get("state") or {}
        shards = []
        for owned in self._plan:
            tensors = [self._flat([self._params[i] for i in owned], grads=False)]
            opt_state = []
            for j, i in enumerate(owned):
                entry: dict[str, Any] = {"param": j, "tensors": {}, "values": {}}
                for key, value in per_param.get(i, {}).items():
                    if isinstance(value, torch.Tensor):
                        entry["tensors"][key] = len(tensors)
                        tensors.append(value.detach().to("cpu"))
                    else:
                        entry["values"][key] = value
                if entry["tensors"] or entry["values"]:
                    opt_state.append(entry)
            # no version or clocks: the servers keep their own (a fresh start's)
            meta = {"shapes": [list(self._params[i].shape) for i in owned], "opt_state": opt_state,
                    "tensors": wire.describe_tensors(tensors)}
            shards.append((json.dumps(meta, separators=(",", ":")), tensors))
        self._set_server_states(shards)
        self._optimizer.state.clear()  # the proxy holds hyperparameters only (the servers the state)

    def _set_server_states(self, shards: list[tuple[str, list[torch.Tensor]]]) -> None:
        """Worker 0 sends each server its state (JSON meta, tensors); then every worker pulls."""
        self._finish_pull()
        if self.rank == 0:
            for s, (meta, tensors) in enumerate(shards):
                payload = torch.frombuffer(bytearray(meta.encode()), dtype=torch.uint8)
                head = torch.empty(wire.HEADER, dtype=torch.float64)
                recv = self._post_raw([head], s)
                self._isend(s, [wire.header(wire.STATE_SET, 0, 0, 0, payload.numel(), len(tensors)), payload,
                                *[t.contiguous() for t in tensors]])
                self._wait_sends()
                self._wait(recv[0], s, "load its state")
        self.barrier()
        self.pull()

    def close(self) -> None:
        """Tell the servers this worker is done (they stop once every live worker is)."""
        if self._closed or self._model is None or self.role != WORKER:
            self._closed = True
            return
        try:
            self._finish_pull()
            for s in range(self.servers):
                self._isend(s, [wire.header(wire.DONE)])
            self._wait_sends()
            if self._server_thread is not None:
                # colocated: our server serves the others until they are done too
                self._server_thread.join(self.timeout)
                if self._server_thread.is_alive():
                    print(f"partrain: warning: parameter server {self._local_server} (a thread of worker "
                          f"{self.rank}) still serving after {self.timeout:g} s", file=sys.stderr, flush=True)
        except Exception as exc:  # never mask the error that brought us here
            print(f"partrain: warning: ps worker {self.rank} could not say goodbye to the servers: {exc}",
                  file=sys.stderr)
        finally:
            self._closed = True


class _ServerOptimizer(Optimizer):
    """The worker's optimizer proxy: same parameter groups, ``step()`` talks to the servers.

    A real `Optimizer` subclass so ``torch.optim.lr_scheduler`` accepts it; the
    hyperparameters a scheduler writes into ``param_groups`` travel with every
    push. Its ``state_dict()`` holds the groups' hyperparameters only; the
    optimizer state itself lives on the servers (`ParameterServer.state_dict`).
    """

    def __init__(self, strategy: ParameterServer, inner: Optimizer) -> None:
        self._strategy = strategy
        self.inner_class = type(inner)
        super().__init__([dict(g) for g in inner.param_groups], dict(inner.defaults))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._strategy.push()
        return loss


STATE_FORMAT = "partrain.ps/1"


def is_ps_state(state: Any) -> bool:
    """Whether a checkpoint's strategy entry is the ps strategy's (its servers' states)."""
    return isinstance(state, dict) and state.get("format") == STATE_FORMAT and isinstance(state.get("servers"), list)


def ps_optimizer_states(state: dict[str, Any], numels: list[int]) -> dict[int, dict[str, Any]]:
    """The optimizer state a ps checkpoint keeps on its servers, by parameter number (the
    optimizer's order), as in an optimizer's ``state_dict()["state"]``: for another strategy,
    or another server count, to resume with (the checkpoint's ``optimizer`` entry holds only
    the hyperparameters).

    ``numels``: the sizes of the resuming optimizer's parameters, for a checkpoint older
    than the shard plan it now carries.
    """
    shards = state["servers"]
    plan = state.get("plan") or wire.plan_shards(numels, len(shards))
    merged: dict[int, dict[str, Any]] = {}
    for owned, shard in zip(plan, shards, strict=True):
        meta = json.loads(shard["meta"])
        if len(meta["shapes"]) != len(owned):
            raise UsageError(f"Expected the ps checkpoint's server {meta.get('server')} to hold {len(owned)} "
                             f"parameters. Received: {len(meta['shapes'])}")
        for entry in meta["opt_state"]:
            one = {key: shard["tensors"][i] for key, i in entry["tensors"].items()}
            one.update(entry["values"])
            merged[owned[entry["param"]]] = one
    return merged


def _describe_optimizer(optimizer: Optimizer) -> tuple[dict[str, Any], list[tuple[int, str, int | None, bool]]]:
    """The class path and JSON hyperparameters the servers rebuild it from, and the numeric slots."""
    cls = type(optimizer)
    groups = []
    slots: list[tuple[int, str, int | None, bool]] = []
    for g, group in enumerate(optimizer.param_groups):
        hp = {}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor):
                raise UsageError(f"Expected plain-number hyperparameters for the ps strategy. Received: "
                                 f"param_groups[{g}][{key!r}] is a tensor")
            if _jsonable(value):
                hp[key] = list(value) if isinstance(value, tuple) else value
            if _is_number(value):
                slots.append((g, key, None, isinstance(value, int)))
            elif isinstance(value, (tuple, list)) and value and all(_is_number(v) for v in value):
                slots.extend((g, key, i, isinstance(v, int)) for i, v in enumerate(value))
        groups.append(hp)
    defaults = {k: (list(v) if isinstance(v, tuple) else v) for k, v in optimizer.defaults.items()
                if _jsonable(v) and not isinstance(v, torch.Tensor)}
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "defaults": defaults, "groups": groups}, slots


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _jsonable(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (tuple, list)):
        return all(_jsonable(x) for x in v)
    return False


def _hp_values(groups: list[dict[str, Any]], slots: list[tuple[int, str, int | None, bool]]) -> torch.Tensor:
    vals = []
    for g, key, i, _ in slots:
        v = groups[g][key]
        vals.append(float(v if i is None else v[i]))
    return torch.tensor(vals, dtype=torch.float64)

