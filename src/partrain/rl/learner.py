"""The learner: holds the model, trains on incoming segments, publishes every update as a version.

Threads of a learner process and what each owns:

- the *training* thread (whoever calls `Learner.train`): takes segments off the
  bounded experience queue, runs ``algorithm.update`` on ``model``, publishes;
- the HTTP server (`partrain.rl.app`, uvicorn on its own event-loop thread) and the
  central-inference `Batcher`'s worker thread: they read the *acting* copy of the
  model, never ``model`` itself, so an update in progress is never seen half-done.

`publish` copies ``model``'s weights into the acting copy and increments the version
under one lock: an answer and its version always agree. Weights are serialised for
local-inference actors lazily, once per version, when the first actor asks.

Versions are monotonic, across restarts too: every ``checkpoint_every``-th version is
written to the checkpoint before it is published, so a run that crashed had published
fewer than ``checkpoint_every`` versions past its last checkpoint; the resumed run
starts at that checkpoint's version plus ``checkpoint_every``.
"""

from __future__ import annotations

import copy
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .. import _stats
from ..checkpoint import load_checkpoint, save_checkpoint
from ..errors import UsageError
from ..optim import keep_run_settings
from .algorithms import Algorithm, VTrace, default_optimizer
from .envs import sample_actions
from .wire import Segment, encode_weights, stack_segments

log = logging.getLogger("partrain.rl")

#: an actor counts as acting (`Learner.active_actors`) this many seconds after its last segment
ACTIVE_WITHIN = 3.0


class ExperienceFull(RuntimeError):
    """The experience queue is full: the actor should retry later (HTTP 503 + Retry-After)."""


class StaleWeights(RuntimeError):
    """A segment acted by weights older than ``max_lag`` versions (HTTP 409: pull new weights)."""


class TrainingDone(RuntimeError):
    """The learner has stopped training and accepts no more segments (HTTP 410)."""


@dataclass
class LearnerStats:
    """Running figures of one learner (``GET /rl/v1/stats``)."""

    frames: int = 0  # environment frames in accepted segments
    segments: int = 0
    rejected_full: int = 0
    rejected_stale: int = 0
    episodes: int = 0
    returns: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    lags: list[int] = field(default_factory=list)  # learner version - segment version, per segment trained
    started: float = field(default_factory=time.perf_counter)  # the clock's origin (see Learner.train)
    startup_seconds: float = 0.0  # from train() to the clock's origin (waiting for actors)
    solved_at: float | None = None  # seconds from start to the target mean return
    solved_frames: int | None = None
    idle: bool = False  # train() ended because no segment came for idle_timeout seconds
    last_update: dict[str, float] = field(default_factory=dict)

    def mean_return(self) -> float:
        return sum(self.returns) / len(self.returns) if self.returns else math.nan


def percentile(values: list[int] | list[float], q: float) -> float:
    """The ``q``-th percentile (0..100, nearest rank) of ``values``; nan when empty."""
    return _stats.percentile(values, q / 100)


class Learner:
    """Trains ``model`` with ``algorithm`` on segments sent by actors; serves weights and actions.

    ``model(obs) -> (logits, value)`` (see `partrain.rl.algorithms`). ``unroll``: the
    segment length every actor must send; ``batch_segments``: segments per update (None: one
    per actor acting, at least 2 and at most ``max_queue``, see `batch_target`);
    ``max_queue``: segments that may wait before actors are told to retry later;
    ``max_lag``: how many versions old a segment's weights may be before the actor is
    told to pull new ones. ``checkpoint``: a path written every ``checkpoint_every``
    versions and read back with ``resume=True``. ``model_spec``: what actors need to build
    the model for local inference (`ActorCritic.spec` when the model has one).
    """

    def __init__(self, model: nn.Module, algorithm: Algorithm | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *, obs_shape: tuple[int, ...],
                 num_actions: int, unroll: int = 16, batch_segments: int | None = None, max_queue: int = 8,
                 max_lag: int = 10, lr: float = 1e-3, env: str | None = None,
                 checkpoint: str | None = None, checkpoint_every: int = 100, resume: bool = False,
                 window: int = 20, seed: int = 0, model_spec: dict[str, Any] | None = None):
        counts = (("unroll", unroll), ("max_queue", max_queue), ("max_lag", max_lag),
                  ("checkpoint_every", checkpoint_every), ("window", window))
        for name, value in counts + ((("batch_segments", batch_segments),) if batch_segments is not None else ()):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"Expected {name} >= 1. Received: {name}={value!r}")
        self.model = model
        #: where the model trains and central inference runs: its parameters' device (move the model
        #: before building the learner); segments arrive on the CPU and go there for each update
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.algorithm: Algorithm = algorithm if algorithm is not None else VTrace()
        self.optimizer = optimizer if optimizer is not None else default_optimizer(model, lr)
        self.obs_shape = tuple(int(d) for d in obs_shape)
        self.num_actions = int(num_actions)
        self.unroll, self.batch_segments, self.max_lag = unroll, batch_segments, max_lag
        self.env = env
        self.checkpoint, self.checkpoint_every = checkpoint, checkpoint_every
        spec = getattr(model, "spec", None)
        self.model_spec = model_spec if model_spec is not None else (spec() if callable(spec) else None)
        self.stats = LearnerStats(returns=deque(maxlen=window))
        self.history: list[dict[str, Any]] = []
        self.version = 0
        self.finished = False
        self.acting = copy.deepcopy(model).eval()
        for p in self.acting.parameters():
            p.requires_grad_(False)
        self._lock = threading.Lock()  # acting copy, version and the weights cache change together
        self._weights: tuple[int, bytes] | None = None
        self._pulled = False  # the current version's weights were asked for: serialise the next one eagerly
        self._queue: queue.Queue[Segment] = queue.Queue(maxsize=max_queue)
        self._generator = torch.Generator().manual_seed(seed)
        self._stop = threading.Event()
        self._seen: dict[str, float] = {}  # actor name -> when its last segment arrived
        self._told: set[str] = set()  # actors answered "training ended"
        if resume:
            if checkpoint is None:
                raise UsageError("Expected a checkpoint path with resume=True. Received: checkpoint=None")
            self._resume(checkpoint)
        self.publish(increment=False)

    # ------------------------------------------------------------------ versions and weights

    def publish(self, increment: bool = True) -> int:
        """Copy the trained weights into the acting copy as the next version; return it.

        When the previous version's weights were asked for (local-inference actors pull every
        version), the new ones are serialised here, on the training thread, so that the server
        answers from `cached_weights` without a thread hop of its own (~0.35 ms of CPU each).
        """
        with self._lock, torch.no_grad():
            for dst, src in zip(self.acting.state_dict().values(), self.model.state_dict().values()):
                dst.copy_(src)
            if increment:
                self.version += 1
            self._weights = None
            version, pulled, self._pulled = self.version, self._pulled, False
        if pulled:  # only this thread writes the acting copy: serialised outside the lock
            blob = encode_weights(self.acting.state_dict(), version)
            with self._lock:
                if self.version == version and self._weights is None:
                    self._weights = (version, blob)
        return version

    def weights(self) -> tuple[int, bytes]:
        """``(version, safetensors bytes)`` of the acting weights; serialised once per version."""
        with self._lock:
            self._pulled = True
            if self._weights is None or self._weights[0] != self.version:
                self._weights = (self.version, encode_weights(self.acting.state_dict(), self.version))
            return self._weights

    def cached_weights(self) -> tuple[int, bytes] | None:
        """`weights` when the current version is serialised already (no lock, no work), else None."""
        cached = self._weights
        if cached is None or cached[0] != self.version:
            return None
        self._pulled = True
        return cached

    def act(self, obs: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Central inference on a batch: ``(actions, logp, logits, value, version)`` row by row, on the
        CPU (the acting copy runs where the model is; actions are drawn on the CPU)."""
        with self._lock:
            logits, value = self.acting(obs.to(self.device))
            version = self.version
        if self.device.type != "cpu":
            logits, value = logits.cpu(), value.cpu()
        actions, logp = sample_actions(logits, self._generator)
        return actions, logp, logits, value, torch.full_like(actions, version)

    # ------------------------------------------------------------------ experience

    def offer(self, segment: Segment, wait: float = 0.0) -> int:
        """Queue one segment for training, waiting at most ``wait`` s for room; the current version.

        The wait is the actors' back-pressure: a queue that stays short keeps the policy lag
        short (a segment waits about ``max_queue / batch_target()`` updates at most).

        Raises `TrainingDone`, `StaleWeights` (acted by weights older than ``max_lag``
        versions) or `ExperienceFull` (the queue holds ``max_queue`` segments).
        """
        version = self._admit(segment)
        if not self._put(segment, wait):
            self.stats.rejected_full += 1
            raise ExperienceFull(f"Expected room in the experience queue. Received: a segment while "
                                 f"{self._queue.maxsize} wait; retry later")
        return version

    def offer_nowait(self, segment: Segment) -> int | None:
        """`offer` without waiting: the current version, or None (nothing counted) when the queue
        has no room now. The server calls it on its event loop and waits for room, `offer(segment,
        wait)` on a thread, only when it answers None: a thread hop costs ~0.35 ms of CPU and
        ~0.5 ms of latency per segment on a 2-core host."""
        version = self._admit(segment)
        return version if self._put(segment, 0.0) else None

    def _put(self, segment: Segment, wait: float) -> bool:
        """Into the queue, waiting at most ``wait`` s for room; False if there was none."""
        try:
            self._queue.put(segment, timeout=wait) if wait > 0 else self._queue.put_nowait(segment)
        except queue.Full:
            return False
        return True

    def _admit(self, segment: Segment) -> int:
        """The checks of `offer` before the queue: the current version, or `TrainingDone`,
        `StaleWeights`, ValueError (a segment of another length)."""
        self._seen[segment.actor] = time.monotonic()
        if self.finished:
            self._told.add(segment.actor)
            raise TrainingDone("Expected a learner that is training. Received: a segment after training ended")
        steps = int(segment.tensors["actions"].shape[0])
        if steps != self.unroll:
            raise ValueError(f"Expected segments of {self.unroll} steps (the learner's unroll). "
                             f"Received: {steps} steps")
        version = self.version
        if segment.version < version - self.max_lag:
            self.stats.rejected_stale += 1
            raise StaleWeights(f"Expected a segment acted by weights version >= {version - self.max_lag} "
                               f"(at most {self.max_lag} behind {version}). Received: version "
                               f"{segment.version}; pull the latest weights")
        return version

    def active_actors(self, within: float = ACTIVE_WITHIN) -> int:
        """Actors (by name) that sent a segment in the last ``within`` s and were not told training ended."""
        now = time.monotonic()
        return sum(1 for name, t in list(self._seen.items()) if now - t < within and name not in self._told)

    def batch_target(self) -> int:
        """Segments per update: ``batch_segments`` where set, else one per active actor (at least 2,
        at most ``max_queue``).

        One segment per actor keeps the policy lag at about one version however many actors
        act: each update waits for a round of segments, and every actor pulls the new version
        before its next one. A fixed 2 with 4 actors (CartPole-v1, 2 cores, seeds 0-5) lagged
        2 versions and 4 runs of 6 did not reach 475 in 300k frames; one per actor lagged 1 and
        all 6 did, in 94-151k frames.
        """
        if self.batch_segments is not None:
            return self.batch_segments
        return min(self._queue.maxsize, max(2, self.active_actors()))

    def actors_still_sending(self, within: float = ACTIVE_WITHIN) -> bool:
        """True while an actor that sent a segment in the last ``within`` s was not told training ended."""
        return self.active_actors(within) > 0

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    # ------------------------------------------------------------------ training

    def stop(self) -> None:
        """Ask `train` to return after the update in progress."""
        self._stop.set()

    def train(self, *, max_frames: int | None = None, target: float | None = None,
              timeout: float | None = None, idle_timeout: float | None = None,
              on_report: Callable[[dict[str, Any]], None] | None = None,
              report_every: float = 2.0, wait_actors: int = 0) -> LearnerStats:
        """Train until ``max_frames`` frames, the recent mean return reaches ``target``, ``timeout``
        seconds, ``stop()``, or ``idle_timeout`` seconds without a segment (all optional).

        ``on_report(row)`` gets a row of figures every ``report_every`` seconds and at the end.
        ``wait_actors``: first wait until that many distinct actors have each sent a segment
        (they are up and acting), dropping those segments, then start from the model as it is
        (fresh, for a new run): the clock (``stats.started``, hence ``solved_at`` and frames/s)
        starts there and the frames counted are the ones acted after it; ``timeout`` still
        counts from the call. The wait is ``stats.startup_seconds``.
        """
        st = self.stats
        st.started = time.perf_counter()
        called = st.started
        ready: set[str] = set()
        deadline = None if timeout is None else time.monotonic() + timeout
        last_segment = time.monotonic()
        next_report = time.monotonic() + report_every
        pending: list[Segment] = []
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    break
                if max_frames is not None and st.frames >= max_frames:
                    break
                if idle_timeout is not None and now - last_segment > idle_timeout:
                    st.idle = True  # no actor for idle_timeout seconds: the run ends, the caller says so
                    break
                if now >= next_report:
                    self._record(on_report)
                    next_report = now + report_every
                try:
                    segment = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                last_segment = time.monotonic()
                if len(ready) < wait_actors:  # not every actor is acting yet: the run has not begun
                    ready.add(segment.actor)
                    if len(ready) == wait_actors:
                        while True:  # what early actors queued was acted before the clock too
                            try:
                                self._queue.get_nowait()
                            except queue.Empty:
                                break
                        st.started = time.perf_counter()
                        st.startup_seconds = st.started - called
                    continue
                pending.append(segment)
                st.frames += segment.frames
                st.segments += 1
                for r in segment.episode_returns:
                    st.returns.append(r)
                    st.episodes += 1
                if len(pending) < self.batch_target():
                    continue
                self._update(pending)
                pending = []
                if (target is not None and st.solved_at is None and len(st.returns) == st.returns.maxlen
                        and st.mean_return() >= target):
                    st.solved_at = time.perf_counter() - st.started
                    st.solved_frames = st.frames
                    break
        finally:
            self.finished = True
            self._record(on_report)
        return st

    def _update(self, segments: list[Segment]) -> None:
        for s in segments:
            self.stats.lags.append(self.version - s.version)
        batch = stack_segments(segments)
        if self.device.type != "cpu":
            batch = {name: t.to(self.device) for name, t in batch.items()}
        self.model.train()
        if getattr(self.algorithm, "min_epochs", None) is not None:  # passes while the next batch is collected
            self.stats.last_update = self.algorithm.update(  # type: ignore[call-arg]
                self.model, self.optimizer, batch, enough=lambda: self._queue.qsize() >= self.batch_target())
        else:
            self.stats.last_update = self.algorithm.update(self.model, self.optimizer, batch)
        # checkpoint *before* publishing: a version that is a multiple of checkpoint_every is
        # never seen by an actor unless it is on disk, so a crash at any point leaves the last
        # published version below (checkpoint's version + checkpoint_every), where a resumed
        # learner starts (published first, a crash before the save would have let the resumed
        # learner reuse a version number that actors already hold with other weights)
        upcoming = self.version + 1
        if self.checkpoint is not None and upcoming % self.checkpoint_every == 0:
            self.save(self.checkpoint, version=upcoming)
        self.publish()

    def report(self) -> dict[str, Any]:
        """One row of figures: frames, frames/s, return, policy lag, queue, last update's losses."""
        st = self.stats
        seconds = time.perf_counter() - st.started
        lags = st.lags[-1000:]
        row: dict[str, Any] = {
            "version": self.version, "seconds": round(seconds, 3), "frames": st.frames,
            "fps": st.frames / seconds if seconds > 0 else 0.0, "episodes": st.episodes,
            "mean_return": st.mean_return(), "lag_p50": percentile(lags, 50), "lag_p99": percentile(lags, 99),
            "queue": self.queue_depth, "rejected_full": st.rejected_full, "rejected_stale": st.rejected_stale,
        }
        row.update(st.last_update)
        return row

    def _record(self, on_report: Callable[[dict[str, Any]], None] | None) -> None:
        row = self.report()
        self.history.append(row)
        if on_report is not None:
            on_report(row)

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: str, version: int | None = None) -> None:
        """An atomic checkpoint of the model, optimizer and version (read with weights_only=True).

        ``version``: the version these weights are (about to be) published as; default the
        current one.
        """
        version = self.version if version is None else version
        save_checkpoint(path, {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "model_spec": self.model_spec, "step": version,
            "config": {"checkpoint_every": self.checkpoint_every, "env": self.env},
            "rl": {"version": version, "frames": self.stats.frames, "episodes": self.stats.episodes,
                   "returns": list(self.stats.returns)},
        })

    def _resume(self, path: str) -> None:
        state = load_checkpoint(path)
        if "rl" not in state:
            raise UsageError(f"Expected a checkpoint written by partrain.rl.Learner. Received: {path!r} "
                             f"without an 'rl' entry")
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as exc:
            raise UsageError(f"Expected a checkpoint of this model. Received: {path!r} "
                             f"({str(exc).splitlines()[0]})") from None
        asked = [dict(group) for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        changed = keep_run_settings(self.optimizer, asked)  # this run's lr and the like win
        if changed:  # a warning: shown without any logging set up (`partrain rl serve`)
            log.warning("resuming with this run's optimizer settings where the checkpoint's differ: %s",
                        ", ".join(changed))
        rl = state["rl"]
        every = int(state.get("config", {}).get("checkpoint_every", self.checkpoint_every))
        # the crashed run reached fewer than `every` versions past this checkpoint
        self.version = int(rl["version"]) + every
        self.stats.frames = int(rl["frames"])
        self.stats.episodes = int(rl["episodes"])
        self.stats.returns.extend(float(r) for r in rl["returns"])
