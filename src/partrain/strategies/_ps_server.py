"""One parameter server: owns a shard of the parameters and the optimizer for it.

Threads: one receiver thread per worker blocks in ``recv`` on that worker's
messages (the GIL is released while it waits) and handles each complete message
itself, under the server's lock: applies the update and sends the reply. No
hand-over to another thread sits between a push and its reply (each one costs a
wake-up, and on a busy machine a wait for a core). The lock keeps the optimizer
and the counters to one thread at a time; a slow or dead worker never stalls
the receipt of the others' messages. The main thread waits until every worker
is done or gone (or a handler failed: it raises that error), then joins the
receivers. A worker whose
connection closes is *dead*: in sync mode that is an error naming it; in
bounded and async modes the server warns and carries on with the live ones.

Modes (``staleness``):

- ``0`` (sync): gradients pushed on version ``V`` are summed until every live
  worker (minus ``backup_workers``) has pushed, then their mean is applied
  once; the pushers get version ``V + 1``. A gradient computed on an older
  version arrives late: it is dropped and counted, and its worker gets the
  current version at once.
- ``s > 0`` (bounded, stale-synchronous): each gradient is applied when it
  arrives; the reply (the fresh parameters) to a worker whose clock is more
  than ``s`` ahead of the slowest live worker's clock is held back until the
  slowest catches up. The *lead* sent with a reply is that difference.
- ``inf`` (async): apply, reply at once.

Where it runs: in a process of its own (a server rank), or colocated - a
thread inside a worker process (``colocate=True``). A colocated server talks to
the worker of its own process through two `LocalPipe`s (the same messages,
no sockets) and to the other workers through gloo, like any server.

Frozen elements (`partrain.nn.freeze`): worker 0's hello carries the shard's
masks; the server records them on its parameters and attaches `keep_frozen`
to its optimizer, so every update leaves them and their optimizer state exact.
"""

from __future__ import annotations

import importlib
import math
import queue
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..nn.freeze import freeze, keep_frozen
from . import _ps_wire as wire


@dataclass
class _Message:
    worker: int  # index among the workers
    op: int
    head: torch.Tensor
    payload: list[torch.Tensor] = field(default_factory=list)
    error: str | None = None


class _HandlerFailed(Exception):
    """A receiver thread's handler raised; the main thread re-raises the error."""


def resolve_class(spec: str) -> type:
    """``"module:QualName"`` -> the class (for optimizers rebuilt on the server)."""
    module, _, qual = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def build_optimizer(params: list[torch.Tensor], groups_of: list[int], meta: dict[str, Any]) -> Any:
    """The worker's optimizer class with its hyperparameters, over this shard's tensors."""
    opt_meta = meta["optimizer"]
    cls = resolve_class(opt_meta["class"])
    groups = []
    for g, hp in enumerate(opt_meta["groups"]):
        mine = [p for p, gi in zip(params, groups_of, strict=True) if gi == g]
        if mine:
            groups.append({"params": mine, **restore_hp(hp)})
    if not groups:
        return None
    defaults = restore_hp(opt_meta["defaults"])
    try:
        return cls(groups, **defaults)
    except TypeError:  # a class whose defaults are not all constructor arguments
        return cls(groups)


def restore_hp(hp: dict[str, Any]) -> dict[str, Any]:
    """JSON turned tuples (Adam's betas) into lists: turn them back."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in hp.items()}


class Server:
    """The serving loop of one server rank. ``run()`` returns when every worker is done or dead."""

    def __init__(self, *, index: int, worker_ranks: list[int], group: Any, staleness: float,
                 backup_workers: int, staleness_lr: bool, timeout: float,
                 local: dict[int, tuple[wire.LocalPipe, wire.LocalPipe]] | None = None) -> None:
        self.index = index
        #: colocated: worker index -> (its requests, our replies) for the worker in our own process
        self.local = local or {}
        self.worker_ranks = worker_ranks
        self.group = group
        self.staleness = staleness
        self.backup_workers = backup_workers
        self.staleness_lr = staleness_lr
        self.timeout = timeout
        n = len(worker_ranks)
        self.flat: torch.Tensor | None = None  # this shard's parameters, one buffer (a view of reply_buf)
        self.reply_buf: torch.Tensor | None = None  # the reply frame: header | flat
        self.grad_flat: torch.Tensor | None = None
        self.params: list[torch.Tensor] = []
        self.optimizer: Any = None
        self.meta: dict[str, Any] = {}
        self.hp_slots: list[tuple[int, str, int | None, bool]] = []
        self.version = 0
        self.clocks = [0] * n
        self.done: set[int] = set()
        self.dead: set[int] = set()
        self.waiting: dict[int, tuple[float, float]] = {}  # worker -> (tau, applied) of its pending reply
        self.hello_waiting: list[int] = []
        # sync mode: the round in progress
        self.round_sum: torch.Tensor | None = None
        self.round_workers: list[int] = []
        self._hp_last = torch.empty(0, dtype=torch.float64)
        # reductions for the workers' all_reduce_sum (bounded/async modes)
        self.reductions: dict[int, tuple[torch.Tensor, set[int]]] = {}
        # figures
        self.hist: list[Counter[int]] = [Counter() for _ in range(n)]
        self.max_lead = [0] * n
        self.dropped = [0] * n
        self.updates = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.started = time.monotonic()
        self.first_update: float | None = None
        self.last_update: float | None = None
        self.lock = threading.Lock()
        #: receivers -> main thread: None after each handled message, or the error a handler raised
        self.events: queue.Queue[BaseException | None] = queue.Queue()

    # ----- modes -------------------------------------------------------------------------
    @property
    def sync(self) -> bool:
        return self.staleness == 0

    def live(self) -> list[int]:
        """Workers still training: neither finished nor dead."""
        return [w for w in range(len(self.worker_ranks)) if w not in self.done and w not in self.dead]

    # ----- receiving ---------------------------------------------------------------------
    def _irecv(self, w: int, t: torch.Tensor) -> Any:
        """Post the receive of worker ``w``'s next message part into ``t``."""
        if w in self.local:
            return self.local[w][0].irecv(t)
        return dist.irecv(t, self.worker_ranks[w], group=self.group, tag=wire.TAG)

    def _receiver(self, w: int) -> None:
        """Thread: receive and handle worker ``w``'s messages until it is done or gone.

        Every message starts with a frame; until the worker's hello says how large its
        pushes are, the frame is a bare header. A push is that one frame."""
        forever = wire.seconds(365 * 86400)  # a worker may compute for long; death closes the pair
        size = wire.HEADER_BYTES
        dtype = torch.float32
        try:
            while True:
                buf = torch.empty(size, dtype=torch.uint8)
                self._irecv(w, buf).wait(forever)
                head = buf[:wire.HEADER_BYTES].view(torch.float64)
                op = int(head[0])
                if op == wire.PUSH:
                    parts = [(int(head[2]), torch.float64), (int(head[3]), dtype)]
                    payload = wire.split_frame(buf, parts)[1]
                    self.bytes_in += wire.frame_bytes(parts)
                else:
                    payload = self._recv_payload(w, op, head)
                    self.bytes_in += wire.HEADER_BYTES + sum(wire.nbytes(t) for t in payload)
                if op == wire.HELLO:  # now we know the size of this worker's pushes
                    spec = wire.decode_json(payload[0])
                    dtype = wire.dtype_from(spec["dtype"])
                    size = max(size, wire.frame_bytes([(len(spec["hp_slots"]), torch.float64),
                                                       (spec["numel"], dtype)]))
                self._handle_here(_Message(w, op, head, payload))
                if op == wire.DONE:
                    return
        except _HandlerFailed:
            return
        except Exception as exc:  # the connection closed: the worker died
            try:
                self._handle_here(_Message(w, -1, torch.empty(0),
                                           error=f"{type(exc).__name__}: {exc}".splitlines()[0]))
            except _HandlerFailed:
                return

    def _handle_here(self, msg: _Message) -> None:
        """Handle ``msg`` on this (receiver) thread under the lock; a failure goes to the main thread."""
        try:
            with self.lock:
                self.handle(msg)
        except BaseException as exc:
            self.events.put(exc)
            raise _HandlerFailed from exc
        self.events.put(None)  # wake the main thread: a worker may be done or gone

    def _recv(self, w: int, t: torch.Tensor) -> torch.Tensor:
        self._irecv(w, t).wait(wire.seconds(self.timeout))
        return t

    def _recv_payload(self, w: int, op: int, head: torch.Tensor) -> list[torch.Tensor]:
        if op == wire.HELLO:
            meta = self._recv(w, torch.empty(int(head[4]), dtype=torch.uint8))
            out = [meta]
            if head[5] > 0:  # worker 0 sends the initial parameters, then the frozen masks (if any)
                spec = wire.decode_json(meta)
                out.append(self._recv(w, torch.empty(spec["numel"], dtype=wire.dtype_from(spec["dtype"]))))
                if spec.get("frozen_numel", 0) > 0:
                    out.append(self._recv(w, torch.empty(spec["frozen_numel"], dtype=torch.uint8)))
            return out
        if op == wire.STATE_SET:
            meta = self._recv(w, torch.empty(int(head[4]), dtype=torch.uint8))
            spec = wire.decode_json(meta)
            return [meta, *wire.recv_described(spec["tensors"], lambda t: self._irecv(w, t), self.timeout)]
        if op == wire.REDUCE:
            return [self._recv(w, torch.empty(int(head[2]), dtype=torch.float64))]
        return []

    # ----- main loop -----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        threads = [threading.Thread(target=self._receiver, args=(w,), daemon=True,
                                    name=f"ps-recv-{w}") for w in range(len(self.worker_ranks))]
        for t in threads:
            t.start()
        while True:
            with self.lock:
                if len(self.done | self.dead) >= len(self.worker_ranks):
                    break
            try:
                event = self.events.get(timeout=1.0)
            except queue.Empty:
                continue
            if event is not None:
                raise event
        self._join(threads)
        return self.stats()

    def _join(self, threads: list[threading.Thread]) -> None:
        """Wait (bounded) until every receiver thread has ended before the process may exit.

        Each ended with its worker's ``done`` or with the error of its closed connection.
        A thread still inside a gloo wait when the interpreter exits is stopped inside
        C++ code, which aborts the process ("terminate called without an active exception").
        """
        deadline = time.monotonic() + self.timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            print(f"partrain: warning: parameter server {self.index}: receiver threads {stuck} still waiting "
                  f"after {self.timeout:g} s", file=sys.stderr, flush=True)

    def handle(self, msg: _Message) -> None:
        w = msg.worker
        if msg.error is not None:
            self._lost(w, msg.error)
            return
        if msg.op == wire.HELLO:
            if self.flat is None and len(msg.payload) > 1:
                self._init(wire.decode_json(msg.payload[0]), msg.payload[1], msg.payload[2:])
            self.hello_waiting.append(w)
            if self.flat is not None:
                for v in self.hello_waiting:
                    self._reply_params(v, 0.0, 1.0)
                self.hello_waiting.clear()
        elif msg.op == wire.PUSH:
            self._push(w, int(msg.head[1]), msg.payload[0], msg.payload[1])
        elif msg.op == wire.PULL:
            self._reply_params(w, 0.0, 1.0)
        elif msg.op == wire.DONE:
            self.done.add(w)
            self._progress()
        elif msg.op == wire.STATS:
            self._send(w, [wire.header(wire.R_JSON, self.version, 0, 0, 0)], json_obj=self.stats())
        elif msg.op == wire.STATE_GET:
            self._send_state(w)
        elif msg.op == wire.STATE_SET:
            self._load_state(wire.decode_json(msg.payload[0]), msg.payload[1:])
            self._send(w, [wire.header(wire.R_ACK, self.version)])
        elif msg.op == wire.REDUCE:
            self._reduce(w, int(msg.head[1]), msg.payload[0])
        else:
            raise RuntimeError(f"parameter server {self.index}: unknown message {msg.op} from worker {w}")

    # ----- state ----------------------------------------------------------------------------
    def _init(self, meta: dict[str, Any], flat: torch.Tensor, masks: list[torch.Tensor]) -> None:
        self.meta = meta
        # the parameters live inside the reply frame: a reply is one send of it, no copy
        self.reply_buf, (self.flat,) = wire.frame(wire.header(wire.R_PARAMS), [(flat.numel(), flat.dtype)])
        self.flat.copy_(flat)
        flat = self.flat
        self.grad_flat = torch.zeros_like(flat)
        offset = 0
        self.params = []
        for shape in meta["shapes"]:
            n = math.prod(shape)
            p = torch.nn.Parameter(flat[offset:offset + n].view(shape), requires_grad=False)
            p.grad = self.grad_flat[offset:offset + n].view(shape)
            self.params.append(p)
            offset += n
        self.optimizer = build_optimizer(self.params, meta["groups_of"], meta)
        frozen = meta.get("frozen", [])
        if frozen:  # the worker's frozen elements: our optimizer steps must leave them exact
            shapes = [meta["shapes"][j] for j in frozen]
            for j, mask in zip(frozen, wire.split_masks(masks[0], shapes), strict=True):
                freeze(self.params[j], mask)
            if self.optimizer is not None:
                keep_frozen(self.optimizer)
        # hyperparameters the worker sends with every push: (group, key, tuple index, is int)
        self.hp_slots = [(g, k, i, is_int) for g, k, i, is_int in meta["hp_slots"]]

    def _apply(self, grad: torch.Tensor, hp: torch.Tensor, scale: float) -> None:
        """One optimizer step on this shard with ``grad`` and the worker's current hyperparameters."""
        assert self.flat is not None and self.grad_flat is not None
        now = time.monotonic()
        self.first_update = self.first_update or now
        self.last_update = now
        self.version += 1
        self.updates += 1
        if self.optimizer is None:
            return
        self.grad_flat.copy_(grad)
        groups = self._set_hp(hp)
        if scale != 1.0:
            for group in groups:
                group["lr"] = group["lr"] * scale
        with torch.no_grad():
            self.optimizer.step()

    def _set_hp(self, hp: torch.Tensor) -> list[dict[str, Any]]:
        """Copy the worker's per-group hyperparameters (an LR scheduler runs there) into ours."""
        by_index = {g: group for g, group in zip(self._group_ids(), self.optimizer.param_groups, strict=True)}
        values = hp.tolist()
        for (g, key, i, is_int), v in zip(self.hp_slots, values, strict=True):
            group = by_index.get(g)
            if group is None:
                continue
            v = int(v) if is_int else v
            if i is None:
                group[key] = v
            else:
                cur = list(group[key])
                cur[i] = v
                group[key] = tuple(cur)
        return list(self.optimizer.param_groups)

    def _group_ids(self) -> list[int]:
        """The worker-side group index of each of our optimizer's groups (empty ones are skipped)."""
        return sorted(set(self.meta["groups_of"]))

    # ----- pushes ----------------------------------------------------------------------------
    def _push(self, w: int, version_read: int, hp: torch.Tensor, grad: torch.Tensor) -> None:
        self.clocks[w] += 1
        tau = self.version - version_read
        if self.sync:
            if version_read < self.version:  # late for its round: dropped (backup workers)
                self.dropped[w] += 1
                self._reply_params(w, float(tau), 0.0)
                return
            if self.round_sum is None:
                self.round_sum = grad.clone()
            else:
                self.round_sum += grad
            self.round_workers.append(w)
            self._hp_last = hp
            self.hist[w][0] += 1
            self._progress()
            return
        self.hist[w][tau] += 1
        scale = 1.0 / max(1, tau) if self.staleness_lr else 1.0
        self._apply(grad, hp, scale)
        self.waiting[w] = (float(tau), 1.0)
        self._progress()

    def _progress(self) -> None:
        """Apply a complete sync round / release replies the staleness bound allows."""
        if self.sync:
            live = self.live()
            need = max(1, len(live) - self.backup_workers)
            arrived = [w for w in self.round_workers if w not in self.dead]
            if self.round_sum is not None and (len(arrived) >= need or not set(live) - set(arrived)):
                mean = self.round_sum / len(self.round_workers)
                self._apply(mean, self._hp_last, 1.0)
                members, self.round_sum, self.round_workers = self.round_workers, None, []
                for w in members:
                    if w not in self.dead:
                        self._reply_params(w, 0.0, 1.0)
            return
        live = self.live()
        slowest = min((self.clocks[u] for u in live), default=None)
        for w in list(self.waiting):
            lead = 0 if slowest is None else max(0, self.clocks[w] - slowest)
            if lead <= self.staleness:
                tau, applied = self.waiting.pop(w)
                self.max_lead[w] = max(self.max_lead[w], lead)
                self._reply_params(w, tau, applied, lead)
        self._release_reductions()

    # ----- replies ---------------------------------------------------------------------------
    def _reply_params(self, w: int, tau: float, applied: float, lead: int = 0) -> None:
        assert self.reply_buf is not None
        self.reply_buf[:wire.HEADER_BYTES].view(torch.float64).copy_(
            wire.header(wire.R_PARAMS, self.version, tau, applied, lead))
        self._send(w, [self.reply_buf])

    def _send(self, w: int, tensors: list[torch.Tensor], json_obj: Any = None) -> None:
        if w in self.dead:
            return
        if json_obj is not None:
            payload = wire.encode_json(json_obj)
            tensors[0][4] = payload.numel()
            tensors = [tensors[0], payload, *tensors[1:]]
        try:
            if w in self.local:  # the worker in our own process (it copies as it takes them)
                for t in tensors:
                    self.local[w][1].isend(t)
                self.bytes_out += sum(wire.nbytes(t) for t in tensors)
            else:
                self.bytes_out += wire.send_tensors(tensors, self.worker_ranks[w], self.group)
        except Exception as exc:
            self._lost(w, f"{type(exc).__name__}: {exc}".splitlines()[0])

    def _lost(self, w: int, why: str) -> None:
        if w in self.dead or w in self.done:
            return
        rank = self.worker_ranks[w]
        if self.sync:
            raise RuntimeError(
                f"parameter server {self.index}: worker {w} (rank {rank}) is gone ({why}); sync mode "
                f"(staleness=0) cannot go on without it - use staleness > 0 to survive worker loss")
        self.dead.add(w)
        self.waiting.pop(w, None)
        print(f"partrain: warning: parameter server {self.index}: worker {w} (rank {rank}) is gone ({why}); "
              f"going on with {len(self.live())} live workers", file=sys.stderr, flush=True)
        self._progress()

    # ----- reductions (the workers' all_reduce_sum when workers may die) ---------------------
    def _reduce(self, w: int, k: int, t: torch.Tensor) -> None:
        total, who = self.reductions.get(k, (torch.zeros_like(t), set()))
        total += t
        who.add(w)
        self.reductions[k] = (total, who)
        self._release_reductions()

    def _release_reductions(self) -> None:
        for k in sorted(self.reductions):
            total, who = self.reductions[k]
            if set(self.live()) - who:
                continue
            del self.reductions[k]
            for w in sorted(who):
                if w not in self.dead:
                    self._send(w, [wire.header(wire.R_REDUCE, self.version), total])

    # ----- checkpoints ------------------------------------------------------------------------
    def _send_state(self, w: int) -> None:
        assert self.flat is not None
        tensors: list[torch.Tensor] = [self.flat]
        opt_state: list[dict[str, Any]] = []
        if self.optimizer is not None:
            for i, p in enumerate(self.params):
                entry: dict[str, Any] = {"param": i, "tensors": {}, "values": {}}
                for key, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        entry["tensors"][key] = len(tensors)
                        tensors.append(value.detach().clone())
                    else:
                        entry["values"][key] = value
                if entry["tensors"] or entry["values"]:
                    opt_state.append(entry)
        meta = {"server": self.index, "version": self.version, "clocks": self.clocks, "updates": self.updates,
                "dropped": self.dropped, "shapes": self.meta.get("shapes"), "opt_state": opt_state,
                "tensors": wire.describe_tensors(tensors)}
        payload = wire.encode_json(meta)
        self._send(w, [wire.header(wire.R_STATE, self.version, 0, 0, payload.numel(), len(tensors)), payload,
                       *tensors])

    def _load_state(self, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        assert self.flat is not None
        if meta.get("shapes") != self.meta.get("shapes"):
            raise RuntimeError(f"parameter server {self.index}: checkpoint shard shapes {meta.get('shapes')} "
                               f"differ from the model's {self.meta.get('shapes')}")
        self.flat.copy_(tensors[0])
        if "version" in meta:  # a ps checkpoint's; another strategy's (parameters and optimizer state) has none
            self.version = int(meta["version"])
            if len(meta["clocks"]) == len(self.clocks):
                self.clocks = [int(c) for c in meta["clocks"]]
                self.dropped = [int(c) for c in meta["dropped"]]
            self.updates = int(meta["updates"])
        if self.optimizer is not None:
            self.optimizer.state.clear()
            for entry in meta["opt_state"]:
                p = self.params[entry["param"]]
                st = {k: tensors[i].clone() for k, i in entry["tensors"].items()}
                st.update(entry["values"])
                self.optimizer.state[p] = st

    # ----- figures ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        span = (self.last_update or 0.0) - (self.first_update or 0.0)
        return {
            "server": self.index,
            "version": self.version,
            "updates": self.updates,
            "updates_per_s": self.updates / span if span > 0 else 0.0,
            "staleness_hist": [{str(k): v for k, v in sorted(h.items())} for h in self.hist],
            "max_lead": self.max_lead,
            "dropped": self.dropped,
            "clocks": self.clocks,
            "dead_workers": sorted(self.dead),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "numel": int(self.flat.numel()) if self.flat is not None else 0,
        }
