"""docs/rl.md's "Wire contract" against the learner: an actor written from the page alone is accepted.

Issue 53 (item 2): a segment built from the page's field table was refused, because the
metadata it needs was in no doc. These tests keep the page and the learner together:

- `examples/rl/actor.sh`, an actor in POSIX shell (curl, awk, printf; no Python, no partrain),
  acts through central inference on a CartPole of its own and sends segments: the learner must
  train on every one, and the files it wrote must be what the page says (tensors, metadata as
  strings, observations that follow CartPole's physics from the row before);
- a segment built with `safetensors.numpy` from the page's tensor and metadata tables (parsed
  from docs/rl.md, never copied here) is accepted, and the keys the table calls required are
  the ones whose absence is refused;
- each malformed segment gets the status and the exact line of the page's error table.

Start reading at `test_the_shell_actor_is_trained_on`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors import numpy as st_numpy

from partrain.rl import ActorCritic, Learner, LearnerServer
from partrain.rl.wire import SEGMENT_FIELDS, encode_segment
from tests.system_packages import find_or_install
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "rl.md"
ACTOR = ROOT / "examples" / "rl" / "actor.sh"
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# the learner of the page's error table: unroll 16, max_lag 10, max_queue 8, 2 actions; segments of E = 2
UNROLL, ENVS, OBS_SHAPE = 16, 2, (4,)


# ------------------------------------------------------------------ the page

def doc_table(header: str) -> list[list[str]]:
    """The rows of the docs/rl.md table whose header row starts with ``header``: cells without backticks."""
    lines = DOC.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    assert start is not None, f"docs/rl.md has no table starting {header!r}"
    rows = []
    for line in lines[start + 2:]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip().strip("|").split("|")])
    return rows


def tensor_table() -> dict[str, tuple[str, str]]:
    """name -> (safetensors dtype, shape expression such as ``[T+1, E, *obs_shape]``)."""
    return {name: (dtype, shape) for name, dtype, shape, _ in doc_table("| tensor | dtype | shape |")}


def metadata_table() -> dict[str, tuple[str, bool, str]]:
    """key -> (type, required, example)."""
    return {key: (kind, required == "yes", example)
            for key, kind, required, _, example in doc_table("| key | type | required |")}


def error_table() -> set[tuple[int, str]]:
    return {(int(status), line) for status, line, _ in doc_table("| status | line |")}


# safetensors' dtype names (its format's own, not partrain's) and the numpy dtypes they are
NUMPY_DTYPES = {"F32": np.float32, "I64": np.int64}
# what the metadata table's "type" column says, as the writer of a value: one per phrase of the page
ENCODERS: dict[str, Callable[[object], str]] = {
    "integer, as a decimal string": lambda value: f"{value:d}",
    "list of numbers, as a JSON string": json.dumps,
    "string": str,
}


def shape_of(expression: str, steps: int, envs: int, obs_shape: tuple[int, ...]) -> tuple[int, ...]:
    dims: list[int] = []
    for term in expression.strip("[]").replace(" ", "").split(","):
        if term == "*obs_shape":
            dims.extend(obs_shape)
        else:
            dims.append({"T": steps, "T+1": steps + 1, "E": envs}[term])
    return tuple(dims)


def segment_from_the_page(version: int = 0, steps: int = UNROLL, envs: int = ENVS,
                          returns: list[float] | None = None,
                          actor: str = "doc-actor") -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Zeros of each table's dtype and shape (versions: ``version``), metadata by the table's types."""
    tensors = {name: np.zeros(shape_of(shape, steps, envs, OBS_SHAPE), NUMPY_DTYPES[dtype])
               for name, (dtype, shape) in tensor_table().items()}
    tensors["versions"][...] = version
    values = {"version": version, "episode_returns": returns if returns is not None else [21.0, 9.0],
              "actor": actor}
    metadata = {key: ENCODERS[kind](values[key]) for key, (kind, _, _) in metadata_table().items()}
    return tensors, metadata


# ------------------------------------------------------------------ a learner

def make_learner(**kw) -> Learner:
    torch.manual_seed(0)
    options = {"obs_shape": OBS_SHAPE, "num_actions": 2, "unroll": UNROLL, "batch_segments": 1,
               "env": "CartPole-v1", "max_lag": 10, "max_queue": 8}
    options.update(kw)
    return Learner(ActorCritic(4, 2, hidden=16), **options)


@pytest.fixture
def served() -> Iterator[tuple[Learner, str]]:
    """A learner with a token behind the real server on a free port; nobody trains."""
    learner = make_learner()
    server = LearnerServer(learner, token=TOKEN)
    url = server.start()
    try:
        yield learner, url
    finally:
        learner.stop()
        server.stop()


def post(url: str, body: bytes, *, headers: dict[str, str] | None = None, params: dict | None = None,
         auth: bool = True) -> httpx.Response:
    return httpx.post(f"{url}/rl/v1/segments", content=body, params=params, timeout=30,
                      headers={**(AUTH if auth else {}), **(headers or {})})


# ------------------------------------------------------------------ the shell actor's tools

@pytest.fixture(scope="module")
def shell_tools() -> dict[str, str]:
    """sh, curl and awk: found, or installed with apt-get where the tests run as root; else a skip."""
    tools = {}
    for tool, package in (("sh", "dash"), ("curl", "curl"), ("awk", "mawk")):
        found, why = find_or_install(lambda tool=tool: shutil.which(tool), package)
        if found is None:
            pytest.skip(f"the shell actor needs {tool}: {why}")
        tools[tool] = found
    return tools


def run_actor(tools: dict[str, str], url: str, *args: str, **settings: str) -> subprocess.CompletedProcess:
    # no proxy variables (curl reads them: the learner is on 127.0.0.1) and none of the actor's own
    env = {k: v for k, v in os.environ.items()
           if "proxy" not in k.lower() and k not in ("NUM_ENVS", "ACTOR_NAME", "ACTOR_SEED", "ACTOR_KEEP")}
    env.update(PARTRAIN_RL_TOKEN=TOKEN, **settings)
    return subprocess.run([tools["sh"], str(ACTOR), url, *args], env=env, capture_output=True, text=True,
                          timeout=180)


def read_header(blob: bytes) -> dict:
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + length])


def cartpole_step(state: np.ndarray, action: np.ndarray) -> np.ndarray:
    """gymnasium's CartPole-v1 step (Euler), on rows of [x, x_dot, theta, theta_dot], in float64."""
    x, x_dot, theta, theta_dot = np.moveaxis(state.astype(np.float64), -1, 0)
    force = np.where(action == 1, 10.0, -10.0)
    cos, sin = np.cos(theta), np.sin(theta)
    temp = (force + 0.05 * theta_dot ** 2 * sin) / 1.1
    theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos ** 2 / 1.1))
    x_acc = temp - 0.05 * theta_acc * cos / 1.1
    return np.stack([x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot,
                     theta_dot + 0.02 * theta_acc], axis=-1)


# ------------------------------------------------------------------ tests

@pytest.mark.timeout(300)
def test_the_shell_actor_is_trained_on_and_writes_what_the_page_says(shell_tools, tmp_path):
    """Three segments from examples/rl/actor.sh: queued, trained (one version each), as documented."""
    learner = make_learner()
    server = LearnerServer(learner, token=TOKEN)
    url = server.start()
    trainer = threading.Thread(target=learner.train, kwargs={"timeout": 240}, name="learner")
    trainer.start()
    keep = tmp_path / "segments"
    keep.mkdir()
    try:
        done = run_actor(shell_tools, url, "3", NUM_ENVS=str(ENVS), ACTOR_NAME="sh-test", ACTOR_KEEP=str(keep))
        assert done.returncode == 0, done.stderr
        assert re.search(r"sh-test: 96 frames, 3 segments, \d+ episodes", done.stdout), done.stdout
        wait_until(lambda: learner.stats.segments == 3 and learner.version == 3, "three segments trained")
        stats = httpx.get(f"{url}/rl/v1/stats", headers=AUTH, timeout=30).json()
        assert stats["frames"] == 3 * UNROLL * ENVS and stats["version"] == 3
        assert stats["batch_sizes"] == {str(ENVS): 3 * UNROLL}  # one inference call per step, E rows each

        # what it wrote: the page's tensors and metadata, and CartPole's physics row after row
        episodes = 0
        for i in (1, 2, 3):
            blob = (keep / f"seg-{i}.safetensors").read_bytes()
            header = read_header(blob)
            metadata = header.pop("__metadata__")
            assert all(isinstance(v, str) for v in metadata.values()) and set(metadata) == set(metadata_table())
            table = tensor_table()
            assert set(header) == set(table)
            tensors = st_numpy.load(blob)
            for name, (dtype, shape) in table.items():
                assert header[name]["dtype"] == dtype
                assert tensors[name].shape == shape_of(shape, UNROLL, ENVS, OBS_SHAPE), name
            assert metadata["version"] == str(tensors["versions"].min()) and metadata["actor"] == "sh-test"
            returns = json.loads(metadata["episode_returns"])
            obs, actions, dones = tensors["obs"], tensors["actions"], tensors["dones"]
            assert (tensors["rewards"] == 1.0).all() and set(np.unique(dones)) <= {0.0, 1.0}
            assert (tensors["logp"] < 0).all() and (tensors["versions"] <= learner.version).all()
            # 48 steps: no episode reaches CartPole's 500-step limit, so every end is a termination
            assert len(returns) == int(dones.sum())
            episodes += len(returns)
            going_on = dones == 0
            predicted = cartpole_step(obs[:-1], actions)
            np.testing.assert_allclose(obs[1:][going_on], predicted[going_on], rtol=1e-5, atol=1e-5)
            assert (np.abs(obs[1:][~going_on]) <= 0.05).all()  # an episode that ended starts afresh
        assert learner.stats.episodes == episodes

        # training over: the actor is told (410) and ends normally
        learner.stop()
        trainer.join(60)
        done = run_actor(shell_tools, url, NUM_ENVS="1", ACTOR_NAME="sh-late")
        assert done.returncode == 0 and "sh-late: the learner ended training" in done.stdout, done.stderr
    finally:
        learner.stop()
        trainer.join(60)
        server.stop()


def test_a_segment_built_from_the_pages_tables_alone_is_accepted(served):
    learner, url = served
    tensors, metadata = segment_from_the_page()
    answer = post(url, st_numpy.save(tensors, metadata=metadata),
                  headers={"Content-Type": "application/vnd.safetensors"})
    assert answer.status_code == 200 and answer.json() == {"version": 0}, answer.text
    assert learner.queue_depth == 1
    # a required key left out is refused, an optional one is not
    for key, (_, required, _) in metadata_table().items():
        without = {k: v for k, v in metadata.items() if k != key}
        answer = post(url, st_numpy.save(tensors, metadata=without))
        assert answer.status_code == (400 if required else 200), (key, answer.text)
    assert any(required for _, required, _ in metadata_table().values())


def test_the_pages_tables_are_the_whole_segment():
    """Every tensor the learner reads and every key partrain's own actor writes is in the tables."""
    torch_dtypes = {"F32": torch.float32, "I64": torch.int64}
    table = tensor_table()
    assert {name: torch_dtypes[dtype] for name, (dtype, _) in table.items()} == {
        name: dtype for name, (dtype, _) in SEGMENT_FIELDS.items()}
    for name, (_, extra) in SEGMENT_FIELDS.items():  # obs has T + 1 rows, the others T
        assert table[name][1].startswith("[T+1," if extra else "[T,"), name
    written = read_header(encode_segment({name: torch.zeros(2, 1) for name in SEGMENT_FIELDS}, [], "a"))
    assert set(written["__metadata__"]) == set(metadata_table())
    for key, (kind, _, example) in metadata_table().items():  # each example is a JSON string of its type
        value = json.loads(example)
        assert isinstance(value, str) and kind in ENCODERS, key
        assert ENCODERS[kind](json.loads(value) if kind != "string" else value) == value, key


def _without(name: str) -> Callable[[dict, dict], None]:
    return lambda tensors, metadata: tensors.pop(name)


MALFORMED: dict[str, Callable[[dict, dict], object]] = {
    "a tensor missing": _without("dones"),
    "actions of one dimension": lambda t, m: t.update(actions=np.zeros(UNROLL, np.int64)),
    "a float64 observation": lambda t, m: t.update(obs=t["obs"].astype(np.float64)),
    "observations of 3 numbers": lambda t, m: t.update(obs=t["obs"][..., :3].copy()),
    "a NaN reward": lambda t, m: t["rewards"].__setitem__((3, 1), math.nan),
    "an action out of range": lambda t, m: t["actions"].__setitem__((5, 0), 2),
    "no version": lambda t, m: m.pop("version"),
    "a version that is not min(versions)": lambda t, m: (t["versions"].__setitem__(..., 2), m.update(version="3")),
    "returns that are not a JSON list": lambda t, m: m.update(episode_returns="21,9"),
    "a NaN return": lambda t, m: m.update(episode_returns="[NaN]"),
    "8 steps for an unroll of 16": lambda t, m: t.update({k: v[:8] if k != "obs" else v[:9] for k, v in t.items()}),
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_a_malformed_segment_gets_the_pages_status_and_line(served, what):
    learner, url = served
    tensors, metadata = segment_from_the_page()
    MALFORMED[what](tensors, metadata)
    answer = post(url, st_numpy.save(tensors, metadata=metadata))
    assert answer.headers["content-type"] == "application/json"
    assert (answer.status_code, answer.json()["error"]) in error_table(), answer.text
    assert learner.queue_depth == 0  # nothing queued; the learner goes on


def test_the_other_refusals_get_the_pages_status_line_and_headers(served):
    """Not safetensors, the token, a method, an encoding, weights_since; then 503, 409 and 410."""
    learner, url = served
    rows = error_table()
    good = st_numpy.save(*segment_from_the_page())

    def documented(answer: httpx.Response, header: str | None = None) -> None:
        assert (answer.status_code, answer.json()["error"]) in rows, answer.text
        if header is not None:
            assert answer.headers.get(header), (header, answer.headers)
            assert f"`{header}" in DOC.read_text()  # the headers table names it

    documented(post(url, b"junk"))
    documented(post(url, good, auth=False), "WWW-Authenticate")
    documented(httpx.get(f"{url}/rl/v1/segments", headers=AUTH, timeout=30), "Allow")
    documented(post(url, good, headers={"Content-Encoding": "br"}), "Accept-Encoding")
    documented(post(url, good, params={"weights_since": "latest"}))
    for _ in range(8):  # nobody trains: eight segments fill the queue, the ninth waits 1 s for room
        assert post(url, good).status_code == 200
    documented(post(url, good), "Retry-After")
    for _ in range(12):
        learner.publish()  # version 12: weights of version 1 are 11 > max_lag behind
    documented(post(url, st_numpy.save(*segment_from_the_page(version=1))), "X-Partrain-Version")
    learner.finished = True
    documented(post(url, st_numpy.save(*segment_from_the_page(version=12))))
