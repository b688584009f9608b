"""`Population`: N copies of one architecture, each with its own seed and hyperparameters.

One `Population.step` steps every member on its own batch. The engine that
does it is picked by measurement (see `engines`): ``"auto"`` times the first
steps of the vectorized and the loop engine on the real batches - those steps
are real training steps, nothing is thrown away - and keeps the faster one.

Members can be spread over the processes of a ``partrain.launch`` job
(``distributed=True``): each process owns a contiguous slice of global member
ids; hyperparameters (small) are known to every process, and a member's
tensors move between processes only by ``torch.distributed`` broadcasts.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError
from .engines import Engine, LoopEngine, MemberDropout, MemberStore, VmapEngine, use_member_dropout
from .functional_optim import make_optimizer

FORMAT = "partrain-population/1"
ENGINES = ("auto", "vmap", "loop")
#: hyperparameters every population understands besides its optimizer's
EXTRA_HPARAMS = {"dropout": 0.0, "batch_size": 0.0}
INTEGER_HPARAMS = ("batch_size",)

HParams = Mapping[str, float | Sequence[float]] | Sequence[Mapping[str, float]]


def member_seed(seed: int, member: int) -> int:
    """The seed member ``member`` is initialized with (the same in any process layout)."""
    return seed * 1_000_003 + member


class Population:
    """N models of one architecture trained together, each with its own hyperparameters.

    Args:
        model_fn: builds one member (called once per member, under that member's seed).
        size: number of members in the whole population.
        optimizer: ``"sgd"`` (momentum, Nesterov, weight decay), ``"adam"`` or ``"adamw"``.
        hparams: per-member hyperparameters: ``{"lr": 0.1}`` (all members),
            ``{"lr": [0.1, 0.01, ...]}`` (one per member) or a list of one dict per member.
            Names: the optimizer's (``lr``, ``momentum``, ``weight_decay`` for SGD;
            ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` for Adam/AdamW),
            ``dropout`` (the model's ``nn.Dropout`` rate, per member) and ``batch_size``
            (per-member batch size; smaller batches are masked inside a padded one).
        engine: ``"auto"`` (time both, keep the faster), ``"vmap"`` or ``"loop"``.
        seed: member ``i`` is built after ``torch.manual_seed(member_seed(seed, i))``.
        nesterov: Nesterov momentum (SGD only).
        device: where members live (default: CPU).
        distributed: spread members over the processes of the current process group.
        group: the process group to use (default: the whole job).
        calibration_steps: timed steps per engine for ``engine="auto"`` (after one warm-up each).
    """

    def __init__(self, model_fn: Callable[[], nn.Module], size: int, optimizer: str = "sgd",
                 hparams: HParams | None = None, *, engine: str = "auto", seed: int = 0,
                 nesterov: bool = False, device: str | torch.device | None = None,
                 distributed: bool = False, group: Any = None, calibration_steps: int = 3) -> None:
        if not isinstance(size, int) or size < 1:
            raise UsageError(f"Expected a positive population size. Received: size={size!r}")
        if engine not in ENGINES:
            raise UsageError(f"Expected engine among {list(ENGINES)}. Received: engine={engine!r}")
        if calibration_steps < 1:
            raise UsageError(f"Expected calibration_steps >= 1. Received: {calibration_steps!r}")
        self.size = size
        self.seed = seed
        self.optimizer_name = optimizer
        self.nesterov = nesterov
        self.optimizer = make_optimizer(optimizer, nesterov)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.calibration_steps = calibration_steps

        # which members this process owns
        self.group = group
        self.distributed = bool(distributed) and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        if size < self.world:
            raise UsageError(f"Expected at least one member per process. Received: size={size}, processes={self.world}")
        self.start, self.stop = self.bounds(self.rank)

        self._hp = self._hparam_table(hparams)
        self._hp_version = 0
        self._hp_rows: dict[str, torch.Tensor] | None = None

        models = []
        with torch.random.fork_rng(devices=[]):
            for member in self.members:
                torch.manual_seed(member_seed(seed, member))
                model = model_fn()
                if not isinstance(model, nn.Module):
                    raise UsageError(f"Expected model_fn to return an nn.Module. Received: {type(model).__name__}")
                models.append(model)
        self.dropout_buffers: list[str] = []
        if "dropout" in self._hp:
            for model in models:
                self.dropout_buffers = use_member_dropout(model)
            if not self.dropout_buffers:
                raise UsageError("Expected a model with nn.Dropout layers for a per-member 'dropout'. "
                                 "Received: a model without any")
        shapes = [tuple((n, tuple(p.shape)) for n, p in m.named_parameters()) for m in models]
        if any(s != shapes[0] for s in shapes):
            raise UsageError("Expected model_fn to build the same architecture every time. "
                             "Received: models with different parameters")
        self.store = MemberStore(models, self.optimizer, self.device)
        self.template = copy.deepcopy(models[0]).to("meta")
        del models
        self._write_dropout_rates()

        self._engines: dict[str, Engine] = {}
        self._requested = engine
        self.engine_report: dict[str, Any] = {"requested": engine}
        self._current = None if engine == "auto" else engine
        self._timings: dict[str, list[float]] = {"vmap": [], "loop": []}
        self.steps = 0

    # ----------------------------------------------------------------- layout
    def bounds(self, rank: int) -> tuple[int, int]:
        """Global member ids ``[start, stop)`` owned by process ``rank``."""
        return self.size * rank // self.world, self.size * (rank + 1) // self.world

    def owner(self, member: int) -> int:
        """The process rank that owns global member ``member``."""
        for r in range(self.world):
            start, stop = self.bounds(r)
            if start <= member < stop:
                return r
        raise UsageError(f"Expected a member id in [0, {self.size}). Received: {member!r}")

    @property
    def members(self) -> range:
        """Global ids of the members this process owns (its rows, in order)."""
        return range(self.start, self.stop)

    def _row(self, member: int) -> int:
        return member - self.start

    # ---------------------------------------------------------- hyperparameters
    def _hparam_table(self, hparams: HParams | None) -> dict[str, torch.Tensor]:
        allowed = {**self.optimizer.defaults, **EXTRA_HPARAMS}
        if hparams is None:
            hparams = {}
        if isinstance(hparams, Sequence) and not isinstance(hparams, (str, bytes)):
            if len(hparams) != self.size:
                raise UsageError(f"Expected one hyperparameter dict per member ({self.size}). "
                                 f"Received: {len(hparams)}")
            keys = set().union(*(h.keys() for h in hparams))
            hparams = {k: [h.get(k, allowed.get(k, 0.0)) for h in hparams] for k in keys}
        table = {}
        for name, value in hparams.items():
            if name not in allowed:
                raise UsageError(f"Expected hyperparameters among {sorted(allowed)} for optimizer "
                                 f"{self.optimizer_name!r}. Received: {name!r}")
            if isinstance(value, (int, float)):
                values = [float(value)] * self.size
            else:
                values = [float(v) for v in value]
                if len(values) != self.size:
                    raise UsageError(f"Expected {self.size} values for hyperparameter {name!r} (one per "
                                     f"member). Received: {len(values)}")
            table[name] = torch.tensor(values, dtype=torch.float64)
        for name, default in self.optimizer.defaults.items():
            table.setdefault(name, torch.full((self.size,), default, dtype=torch.float64))
        for name, t in table.items():
            self._check_values(name, t)
        return table

    @staticmethod
    def _check_values(name: str, values: torch.Tensor) -> None:
        bad = None
        if not torch.isfinite(values).all():
            bad = "a non-finite value"
        elif name in ("lr", "weight_decay", "momentum", "eps") and (values < 0).any():
            bad = "a negative value"
        elif name in ("beta1", "beta2", "dropout") and ((values < 0) | (values >= 1)).any():
            bad = "a value outside [0, 1)"
        elif name == "batch_size" and (values < 1).any():
            bad = "a batch size below 1"
        if bad:
            raise UsageError(f"Expected valid values for hyperparameter {name!r}. Received: {bad} "
                             f"in {values.tolist()}")

    @property
    def hparam_names(self) -> list[str]:
        return sorted(self._hp)

    @property
    def hparams(self) -> dict[str, list[float]]:
        """Every member's hyperparameters (the whole population, in every process)."""
        return {k: v.tolist() for k, v in sorted(self._hp.items())}

    def member_hparams(self, member: int) -> dict[str, float]:
        """One member's hyperparameters (``batch_size`` as an int)."""
        out: dict[str, float] = {}
        for k, v in sorted(self._hp.items()):
            out[k] = int(v[member]) if k in INTEGER_HPARAMS else float(v[member])
        return out

    def set_hparams(self, member: int, values: Mapping[str, float]) -> None:
        """Change one member's hyperparameters (every process calls it with the same values)."""
        for k, v in values.items():
            if k not in self._hp:
                raise UsageError(f"Expected a hyperparameter among {sorted(self._hp)}. Received: {k!r}")
            v = float(round(v)) if k in INTEGER_HPARAMS else float(v)
            self._check_values(k, torch.tensor([v], dtype=torch.float64))
            self._hp[k][member] = v
        self._hp_version += 1
        self._hp_rows = None
        self._write_dropout_rates()
        self._no_momentum_no_buffer(member)

    def _no_momentum_no_buffer(self, member: int) -> None:
        """Keep the invariant "momentum 0 => zero momentum buffer" (torch.optim keeps none then)."""
        if "momentum_buffer" in self.store.opt and self.start <= member < self.stop \
                and float(self._hp["momentum"][member]) == 0.0:
            with torch.no_grad():
                self.store.opt["momentum_buffer"][self._row(member)].zero_()

    def _rows_of(self, name: str) -> torch.Tensor:
        return self._hp[name][self.start : self.stop]

    def _optimizer_rows(self) -> dict[str, torch.Tensor]:
        if self._hp_rows is None:
            dtype = self.store.flat.dtype
            self._hp_rows = {k: self._rows_of(k).to(dtype=dtype, device=self.device).unsqueeze(1)
                             for k in self.optimizer.defaults}
        return self._hp_rows

    def _write_dropout_rates(self) -> None:
        if self.dropout_buffers:
            rates = self._rows_of("dropout").to(dtype=torch.float32, device=self.device)
            for name in self.dropout_buffers:
                self.store.buffers[name].copy_(rates)

    def batch_sizes(self, default: int) -> list[int]:
        """This process's members' batch sizes (``default`` unless ``batch_size`` is a hyperparameter)."""
        if "batch_size" not in self._hp:
            return [default] * len(self.members)
        return [int(v) for v in self._rows_of("batch_size")]

    # ------------------------------------------------------------------ engines
    @property
    def engine(self) -> str:
        """The engine in use: ``"vmap"``, ``"loop"`` or ``"auto"`` while still measuring."""
        return self._current or "auto"

    def _engine(self, name: str) -> Engine:
        if name not in self._engines:
            if name == "vmap":
                self._engines[name] = VmapEngine(self.store, self.template, self.optimizer)
            else:
                hp = [{k: float(self._hp[k][m]) for k in self.optimizer.defaults} for m in self.members]
                self._engines[name] = LoopEngine(self.store, self.template, self.optimizer, hp)
        return self._engines[name]

    def step(self, x: torch.Tensor | Sequence[torch.Tensor], y: torch.Tensor | None = None,
             sizes: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """Step every member of this process on its own batch; return each member's loss.

        ``x`` is shaped ``(members, B, *sample)`` and ``y`` ``(members, B)``: row ``i``
        is the batch of ``self.members[i]``. ``sizes`` (optional, ``(members,)``) lets
        member ``i`` use only its first ``sizes[i]`` samples. ``step((x, y[, sizes]))``
        works too.
        """
        if y is None:
            if not isinstance(x, (tuple, list)) or len(x) not in (2, 3):
                raise UsageError("Expected step(x, y[, sizes]) or step((x, y[, sizes])). Received one argument")
            x, y, sizes = (*x, None)[:3] if len(x) == 2 else x
        rows = len(self.members)
        if x.dim() < 2 or x.shape[0] != rows or y.shape[:2] != x.shape[:2]:
            raise UsageError(f"Expected x shaped ({rows}, batch, ...) and y shaped ({rows}, batch). "
                             f"Received: x {tuple(x.shape)}, y {tuple(y.shape)}")
        size_t = None
        if sizes is not None:
            size_t = torch.as_tensor(sizes, dtype=torch.long, device=x.device)
            if size_t.shape != (rows,) or (size_t < 1).any() or (size_t > x.shape[1]).any():
                raise UsageError(f"Expected sizes: {rows} integers in [1, {x.shape[1]}]. Received: {size_t.tolist()}")
            if bool((size_t == x.shape[1]).all()):
                size_t = None
        name = self._current or self._calibrating()
        hp = self._optimizer_rows()
        if self._current is None:
            _sync(self.device)
            t0 = time.perf_counter()
            losses = self._engine(name).step(x, y, size_t, hp, self._hp_version)
            _sync(self.device)
            self._timings[name].append(time.perf_counter() - t0)
            self._maybe_choose(x.shape[1])
        else:
            losses = self._engine(name).step(x, y, size_t, hp, self._hp_version)
        self.steps += 1
        return losses

    def _calibrating(self) -> str:
        # alternate the engines step by step (a burst of load from other processes then hits
        # both alike); the first step of each is a warm-up, then `calibration_steps` timed each
        return "vmap" if len(self._timings["vmap"]) <= len(self._timings["loop"]) else "loop"

    def _maybe_choose(self, batch: int) -> None:
        if len(self._timings["loop"]) <= self.calibration_steps:
            return
        # the first step of each engine is a warm-up; keep the best of the rest (others' load is noise)
        best = torch.tensor([min(self._timings[n][1:]) for n in ("vmap", "loop")], dtype=torch.float64)
        if self.distributed:  # every process picks the same engine: the slowest process decides
            dist.all_reduce(best, op=dist.ReduceOp.MAX, group=self.group)
        vmap_s, loop_s = best.tolist()
        self._current = "vmap" if vmap_s <= loop_s else "loop"
        self.engine_report = {"requested": "auto", "chosen": self._current, "vmap_step_s": vmap_s,
                              "loop_step_s": loop_s, "measured_steps": self.calibration_steps,
                              "members": len(self.members), "batch": batch}

    def use_engine(self, name: str) -> None:
        """Force an engine from now on (``"vmap"`` or ``"loop"``); state carries over exactly."""
        if name not in ("vmap", "loop"):
            raise UsageError(f"Expected engine 'vmap' or 'loop'. Received: {name!r}")
        self._current = name
        self.engine_report = {**self.engine_report, "forced": name}

    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> dict[str, torch.Tensor]:
        """Loss and accuracy of this process's members on the same ``(x, y)`` (eval mode, no grad)."""
        engine = self._engine(self._current or "vmap")
        loss, acc = engine.evaluate(x.to(self.device), y.to(self.device), batch_size)
        return {"loss": loss, "accuracy": acc}

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """A per-member value of this process's members -> the whole population's (every process)."""
        out = torch.zeros(self.size, dtype=torch.float64)
        out[self.start : self.stop] = local.detach().to("cpu", torch.float64)
        if self.distributed:
            dist.all_reduce(out, group=self.group)
        return out

    # ------------------------------------------------------------------ members
    def copy_member(self, src: int, dst: int) -> None:
        """Member ``dst`` becomes an exact copy of ``src``: weights, optimizer state, buffers
        and hyperparameters (PBT then explores new ones with `set_hparams`).

        In a distributed population every process calls this with the same arguments;
        the owner of ``src`` broadcasts the member's tensors in one flat buffer.
        """
        if src == dst:
            return
        for values in self._hp.values():
            values[dst] = values[src]
        self._hp_version += 1
        self._hp_rows = None
        src_rank, dst_rank = self.owner(src), self.owner(dst)
        if src_rank == dst_rank:
            if self.rank == src_rank:
                self.store.copy_row(self._row(src), self._row(dst))
            return
        payload = self.member_tensors(src, to_rank=dst_rank)
        if self.rank == dst_rank:
            with torch.no_grad():
                for t, value in zip(self.store.member_tensors(self._row(dst)), payload):
                    t.copy_(value)

    def member_tensors(self, member: int, to_rank: int | None = None) -> list[torch.Tensor]:
        """Copies of a member's tensors (parameters row, optimizer state, buffers).

        In a distributed population every process calls it with the same arguments and
        takes the same path (no process may skip a collective its peers enter): when the
        member lives on ``to_rank`` nothing moves; otherwise its owner broadcasts it. The
        copies come back on ``to_rank`` (on every process when ``to_rank`` is None); the
        other processes get an empty list.
        """
        owner = self.owner(member)
        if not self.distributed:
            return self._local_copies(member)
        if to_rank is not None and not 0 <= to_rank < self.world:
            raise UsageError(f"Expected to_rank in [0, {self.world}) or None. Received: {to_rank!r}")
        wanted = to_rank is None or to_rank == self.rank
        if owner == to_rank:  # already where it is wanted: no collective, on every process alike
            return self._local_copies(member) if self.rank == owner else []
        shapes = [t.shape for t in self.store.member_tensors(0)]
        if self.rank == owner:
            flat = torch.cat([t.detach().reshape(-1) for t in self.store.member_tensors(self._row(member))])
        else:
            flat = torch.empty(sum(s.numel() for s in shapes), dtype=self.store.flat.dtype, device=self.device)
        src = dist.get_global_rank(self.group, owner) if self.group is not None else owner
        dist.broadcast(flat, src=src, group=self.group)
        if not wanted:
            return []
        out, offset = [], 0
        for s in shapes:
            out.append(flat[offset : offset + s.numel()].view(s).clone())
            offset += s.numel()
        return out

    def _local_copies(self, member: int) -> list[torch.Tensor]:
        return [t.detach().clone() for t in self.store.member_tensors(self._row(member))]

    def member_model(self, member: int, tensors: list[torch.Tensor] | None = None) -> nn.Module:
        """A standalone ``nn.Module`` equal to one member (``nn.Dropout`` restored), in eval mode.

        Distributed: every process calls it (the owner broadcasts the member), unless
        ``tensors`` (from `member_tensors`) are given.
        """
        model, _ = self._standalone(member, tensors)
        return model.eval()

    def member_state(self, member: int, tensors: list[torch.Tensor] | None = None
                     ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One member as ``(model.state_dict(), torch.optim optimizer.state_dict())``.

        The optimizer state is what ``torch.optim.SGD/Adam/AdamW`` with this member's
        hyperparameters would hold, so ``partrain train --resume`` can continue it.
        Distributed: as `member_model`.
        """
        model, opt = self._standalone(member, tensors)
        return model.state_dict(), opt.state_dict()

    def _standalone(self, member: int, tensors: list[torch.Tensor] | None
                    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        tensors = tensors if tensors is not None else self.member_tensors(member)
        store = MemberStore.__new__(MemberStore)  # a one-member store around the copies
        store.layout = self.store.layout
        it = iter(tensors)
        store.flat = next(it).unsqueeze(0)
        store.opt = {k: next(it).unsqueeze(0) for k in sorted(self.store.opt)}
        store.buffers = {k: next(it).unsqueeze(0) for k in sorted(self.store.buffers)}
        hp = {k: float(self._hp[k][member]) for k in self.optimizer.defaults}
        engine = LoopEngine(store, self.template, self.optimizer, [hp])
        model, opt = engine.modules[0], engine.optimizers[0]
        if not self.optimizer.torch_counts_steps:
            for state in opt.state.values():
                state.pop("step", None)
        if self.optimizer.name == "sgd" and hp["momentum"] == 0:
            opt.state.clear()  # torch.optim.SGD keeps no buffer without momentum
        _restore_dropout(model)
        return model, opt

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This process's members and the whole hyperparameter table: tensors and primitives only."""
        layout = self.store.layout
        return {
            "format": FORMAT,
            "size": self.size,
            "members": [self.start, self.stop],
            "optimizer": self.optimizer_name,
            "nesterov": self.nesterov,
            "seed": self.seed,
            "params": {k: v.detach().clone() for k, v in layout.views(self.store.flat.detach()).items()},
            "optimizer_state": {k: (v.clone() if k == "step" else
                                    {n: t.clone() for n, t in layout.views(v).items()})
                                for k, v in self.store.opt.items()},
            "buffers": {k: v.clone() for k, v in self.store.buffers.items()},
            "hparams": {k: v.clone() for k, v in self._hp.items()},
            "engine": self._current,
            "engine_report": {k: v for k, v in self.engine_report.items()},
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` saved (same size, process layout, optimizer and model)."""
        if state.get("format") != FORMAT:
            raise UsageError(f"Expected a population state (format {FORMAT!r}). Received: {state.get('format')!r}")
        mine = [self.start, self.stop]
        if state["size"] != self.size or list(state["members"]) != mine:
            raise UsageError(f"Expected a population of {self.size} with members {mine} here. "
                             f"Received: size {state['size']}, members {list(state['members'])}")
        if state["optimizer"] != self.optimizer_name:
            raise UsageError(f"Expected optimizer {self.optimizer_name!r}. Received: {state['optimizer']!r}")
        layout = self.store.layout
        if set(state["params"]) != set(layout.names) or set(state["buffers"]) != set(self.store.buffers):
            raise UsageError("Expected the same model as the saved population. Received: different parameter names")
        with torch.no_grad():
            for k, v in layout.views(self.store.flat.detach()).items():
                v.copy_(state["params"][k])
            for key, saved in state["optimizer_state"].items():
                if key == "step":
                    self.store.opt["step"].copy_(saved)
                else:
                    for k, v in layout.views(self.store.opt[key]).items():
                        v.copy_(saved[k])
            for k, v in self.store.buffers.items():
                v.copy_(state["buffers"][k])
        self._hp = {k: v.clone().to(torch.float64) for k, v in state["hparams"].items()}
        self._hp_version += 1
        self._hp_rows = None
        self._write_dropout_rates()
        if state.get("engine") and self._requested == "auto":
            self._current = state["engine"]
            self.engine_report = dict(state.get("engine_report") or {})
        self.steps = int(state.get("steps", 0))


def _restore_dropout(model: nn.Module) -> None:
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, MemberDropout):
                setattr(module, name, nn.Dropout(float(child.p)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
