"""The actor side: `connect(URL)` from any process, then act, send segments, pull weights.

Two modes, chosen per actor:

- ``"local"``: the actor keeps a copy of the policy and runs it itself. `Actor.pull`
  asks for the weights with ``If-None-Match: "V"`` (its version): an unchanged version
  costs one empty 304 answer, a new one its safetensors bytes, so each version is
  downloaded at most once. ``Actor.send(..., pull=True)`` asks the same question on the
  segment's own request (``?weights_since=V``), so acting, sending and pulling cost one
  round trip per segment; `run_actor` does so every ``pull_every`` segments.
- ``"central"``: the actor sends observations to the learner's Open Inference Protocol
  endpoint and gets actions back; the learner batches every actor's requests.

Every wait is bounded. A learner that is restarting (connection refused) is retried
until ``reconnect_timeout`` (one log line, on the ``partrain.rl`` logger, when an
outage begins and one when the learner answers again); a full experience queue (503) is retried after its
``Retry-After``; a segment refused as too stale (409) is dropped and the weights are
pulled at once; a learner that finished training (410) ends `run_actor` normally.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import os
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UsageError
from ..serve.protocol import HEADER, decode_infer_response, encode_request
from .algorithms import ActorCritic, policy_logits
from .envs import EnvRunner, env_spec, sample_actions
from .wire import CONTENT_TYPE, decode_weights, encode_segment

MODES = ("local", "central")
log = logging.getLogger("partrain.rl")
_UNNAMED = itertools.count()


class LearnerDone(RuntimeError):
    """The learner answered 410: training ended, no more segments are wanted."""


@dataclass
class ActorStats:
    """What one actor did: frames, segments sent, pulls, stale notices, retries, inference latency."""

    frames: int = 0
    segments: int = 0
    dropped: int = 0  # segments refused as stale
    pulls: int = 0  # weights downloads (200 answers)
    unchanged: int = 0  # conditional pulls answered 304
    pulled_versions: list[int] = field(default_factory=list)
    retries: int = 0
    episodes: int = 0
    infer_seconds: list[float] = field(default_factory=list)  # central mode: per request


_CLOSED_WHILE_IDLE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


@dataclass
class Response:
    """One answer: status, headers (case-insensitive ``get``), body."""

    status_code: int
    headers: Any  # http.client.HTTPMessage
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class Connection:
    """One persistent HTTP/1.1 connection to a learner, on the standard library's ``http.client``.

    An actor makes one request per segment (local inference) or one per step (central), so the
    client's own cost counts: a segment's POST cost ~0.28 ms of the actor's CPU here against
    ~1.0 ms through httpx (4 alternating rounds of 500 against one learner).
    A request that fails on the wire (refused, reset, timed out) closes the connection and
    raises ``OSError`` or ``http.client.HTTPException``; the next one connects afresh. The
    learner is reached directly: ``HTTP_PROXY`` and the like are not read.
    """

    def __init__(self, url: str, headers: dict[str, str], timeout: float):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"Expected a learner URL such as http://127.0.0.1:8000. Received: {url!r}")
        self._factory = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._host, self._port, self._prefix = parts.hostname, parts.port, parts.path.rstrip("/")
        self._headers, self._timeout = headers, timeout
        self._conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, *, content: bytes | None = None,
                headers: dict[str, str] | None = None, params: dict[str, Any] | None = None) -> Response:
        target = self._prefix + path + ("?" + urllib.parse.urlencode(params) if params else "")
        for attempt in (1, 2):
            reused = self._conn is not None
            if self._conn is None:
                self._conn = self._factory(self._host, self._port, timeout=self._timeout)
            conn = self._conn
            try:
                conn.request(method, target, body=content, headers={**self._headers, **(headers or {})})
                answer = conn.getresponse()
                body = answer.read()
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                # a kept-alive connection that the server closed while it was idle (uvicorn: after
                # 5 s) fails on its next use, before the request was read: once more on a fresh one
                if reused and attempt == 1 and isinstance(exc, _CLOSED_WHILE_IDLE):
                    continue
                raise
            if answer.will_close:
                self.close()
            return Response(answer.status, answer.msg, body)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class Actor:
    """A connection to a learner (see `connect`)."""

    def __init__(self, url: str, *, token: str | None = None, mode: str = "local",
                 model: nn.Module | None = None, name: str = "", reconnect_timeout: float = 60.0,
                 request_timeout: float = 30.0, seed: int = 0):
        if mode not in MODES:
            raise UsageError(f"Expected mode 'local' or 'central'. Received: {mode!r}")
        self.url = url.rstrip("/")
        self.mode = mode
        # a name per connection by default: the learner counts acting actors by name (one segment each
        # per update) and tells each one when training ended
        self.name = name or f"actor-{socket.gethostname()}-{os.getpid()}-{next(_UNNAMED)}"
        self.reconnect_timeout = reconnect_timeout
        self.stats = ActorStats()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = Connection(self.url, headers, request_timeout)
        self._generator = torch.Generator().manual_seed(seed)
        self.info = self._request("GET", "/rl/v1/info").json()
        self.version = -1
        self.model: nn.Module | None = None
        if mode == "local":
            self.model = model if model is not None else _build(self.info.get("model"))
            self.model.eval()
            self.pull()

    # ------------------------------------------------------------------ HTTP with bounded retries

    def _request(self, method: str, path: str, **kw: Any) -> Response:
        """One request; connection failures retried until ``reconnect_timeout``; 401/400 raise."""
        began = time.monotonic()
        deadline = began + self.reconnect_timeout
        delay, outage = 0.05, False
        while True:
            try:
                response = self._http.request(method, path, **kw)
            except (OSError, http.client.HTTPException) as exc:
                if time.monotonic() + delay > deadline:
                    raise ConnectionError(f"Expected a learner at {self.url}. Received: no answer for "
                                          f"{self.reconnect_timeout:g} s ({type(exc).__name__})") from None
                if not outage:  # said once per outage: a user waiting on an actor sees why
                    outage = True
                    log.warning("%s: no learner answers at %s (%s); retrying for up to %g s", self.name,
                                self.url, type(exc).__name__, self.reconnect_timeout)
                self.stats.retries += 1
                time.sleep(delay)  # a bounded back-off between attempts, not a synchronisation
                delay = min(1.0, delay * 2)
                continue
            if outage:
                outage = False
                log.warning("%s: the learner at %s answers again after %.1f s", self.name, self.url,
                            time.monotonic() - began)
            status = response.status_code
            if status == 503 and time.monotonic() < deadline:  # queue full: retry later, as told
                self.stats.retries += 1
                time.sleep(min(float(response.headers.get("retry-after", "1")), 1.0) * 0.1)
                continue
            if status == 410:
                raise LearnerDone(_error_text(response))
            if status >= 400 and status != 409:  # 409 (stale) is the caller's to handle
                raise RuntimeError(f"{method} {path}: HTTP {status}: {_error_text(response)}")
            return response

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Actor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ weights

    def pull(self) -> bool:
        """Fetch the weights if their version changed (one conditional request); True if new."""
        assert self.model is not None, "pull() is for local-inference actors"
        response = self._request("GET", "/rl/v1/weights", headers={"If-None-Match": f'"{self.version}"'})
        if response.status_code == 304:
            self.stats.unchanged += 1
            return False
        self._load(response.content)
        return True

    def _load(self, blob: bytes) -> None:
        assert self.model is not None
        state, version = decode_weights(blob)
        load_weights(self.model, state)
        self.version = version
        self.stats.pulls += 1
        self.stats.pulled_versions.append(version)

    # ------------------------------------------------------------------ acting

    def act(self, obs: Tensor) -> tuple[Tensor, Tensor, int]:
        """Actions for a batch of observations: ``(actions, logp, version)``."""
        if self.model is not None:
            actions, logp = sample_actions(policy_logits(self.model, obs), self._generator)
            return actions, logp, self.version
        body, headers = encode_request({"obs": obs.float()}, binary=True, binary_output=True,
                                       outputs=["action", "logp", "version"])
        t0 = time.perf_counter()
        response = self._request("POST", f"/v2/models/{self.info['policy_model']}/infer", content=body,
                                 headers=headers)
        self.stats.infer_seconds.append(time.perf_counter() - t0)
        out = decode_infer_response(response.content, response.headers.get(HEADER)).outputs
        version = int(out["version"].min())
        self.version = version
        return out["action"], out["logp"], version

    # ------------------------------------------------------------------ experience

    def send(self, segment: dict[str, Tensor], episode_returns: list[float], *, pull: bool = False) -> bool:
        """Send one segment; False when the learner refused it as too stale (weights pulled then).

        ``pull`` (local inference): the answer brings the weights when the learner's version is
        newer than this actor's, as `pull` would, without a request of its own.
        """
        pull = pull and self.model is not None
        response = self._request("POST", "/rl/v1/segments", content=encode_segment(segment, episode_returns,
                                                                                  self.name),
                                 headers={"Content-Type": CONTENT_TYPE},
                                 params={"weights_since": self.version} if pull else None)
        if response.status_code == 409:  # our weights are too old: this segment is lost, catch up
            self.stats.dropped += 1
            if self.model is not None:
                self.pull()
            return False
        if pull:
            if response.headers.get("content-type", "").startswith(CONTENT_TYPE):
                self._load(response.content)
            else:
                self.stats.unchanged += 1
        self.stats.segments += 1
        self.stats.frames += int(segment["actions"].numel())
        self.stats.episodes += len(episode_returns)
        return True


def load_weights(model: nn.Module, state: dict[str, Tensor]) -> None:
    """``model.load_state_dict(state)``, as a copy into each tensor when the names and shapes match.

    An actor loads every new version (CartPole: one per segment): for `ActorCritic` the copies
    cost ~20-35 us and the ``state_dict`` that finds them ~35-60 us, against ~150-290 us for
    ``load_state_dict`` (its per-module hooks and checks). Anything else (another name,
    another shape) goes through ``load_state_dict`` and its error.
    """
    targets = model.state_dict()  # tensors sharing the parameters' and buffers' storage
    if targets.keys() == state.keys() and all(t.shape == state[k].shape for k, t in targets.items()):
        with torch.no_grad():
            for name, t in targets.items():
                t.copy_(state[name])
    else:
        model.load_state_dict(state)


def _error_text(response: Any) -> str:
    try:
        return str(response.json().get("error", response.text))
    except ValueError:
        return response.text[:200]


def _build(spec: dict[str, Any] | None) -> nn.Module:
    if not spec or spec.get("kind") != "ActorCritic":
        raise UsageError(f"Expected the learner's model spec of kind 'ActorCritic', or a model passed to "
                         f"connect(model=...). Received: {spec!r}")
    return ActorCritic(int(spec["obs_dim"]), int(spec["num_actions"]), int(spec["hidden"]))


def connect(url: str, *, token: str | None = None, mode: str = "local", model: nn.Module | None = None,
            name: str = "", reconnect_timeout: float = 60.0, seed: int = 0) -> Actor:
    """Connect to the learner at ``url`` from any process; see `Actor`.

    ``mode``: ``"local"`` (keep a copy of the policy; ``model`` builds it when the
    learner's model is not an `ActorCritic`) or ``"central"`` (the learner acts).
    ``name``: what the learner calls this actor (default: ``actor-HOST-PID-N``, one per
    connection; the learner counts acting actors by name).
    """
    return Actor(url, token=token, mode=mode, model=model, name=name, reconnect_timeout=reconnect_timeout,
                 seed=seed)


def run_actor(url: str, env: str | None = None, *, num_envs: int = 8, mode: str = "local", pull_every: int = 1,
              token: str | None = None, seed: int = 0, max_frames: int | None = None, name: str = "",
              reconnect_timeout: float = 60.0, on_segment: Callable[[Actor], None] | None = None) -> ActorStats:
    """Act on ``num_envs`` copies of ``env`` (default: the learner's) until the learner finishes.

    Each segment (the learner's ``unroll`` steps) is sent with the version that acted;
    local-inference actors pull new weights every ``pull_every`` segments.
    """
    if pull_every < 1:
        raise UsageError(f"Expected pull_every >= 1. Received: pull_every={pull_every}")
    if env:
        env_spec(env)  # a name gymnasium does not know is one line now, not after waiting for a learner
    torch.set_num_threads(1)  # a tiny policy: one thread, so that actors do not fight over cores
    actor = connect(url, token=token, mode=mode, name=name, reconnect_timeout=reconnect_timeout, seed=seed)
    env_name = env or actor.info.get("env")
    if not env_name:
        raise UsageError("Expected --env NAME (the learner names none). Received: no environment")
    runner = EnvRunner(env_name, num_envs, seed=seed)
    want = (list(actor.info["obs_shape"]), int(actor.info["num_actions"]))
    got = ([int(runner.obs.shape[1])], int(runner.envs[0].action_space.n))
    if want != got:
        runner.close()
        actor.close()
        raise UsageError(f"Expected an environment with the learner's observation shape {want[0]} and "
                         f"{want[1]} actions ({actor.info.get('env')}). Received: {env_name} with {got[0]} "
                         f"and {got[1]} actions")
    unroll = int(actor.info["unroll"])
    sent = 0
    try:
        while max_frames is None or actor.stats.frames < max_frames:
            segment, finished = runner.rollout(actor.act, unroll)
            sent += 1
            actor.send(segment, finished, pull=sent % pull_every == 0)
            if on_segment is not None:
                on_segment(actor)
    except LearnerDone:
        pass
    finally:
        runner.close()
        actor.close()
    return actor.stats
