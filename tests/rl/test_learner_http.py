"""The learner over HTTP: versions, conditional pulls, central inference, bad requests, faults.

One in-process learner served by uvicorn on a free port (the real server, real
sockets); the test plays the actor with `partrain.rl.connect` and with raw HTTP, as
an outside process would. Start reading at `test_versions_are_monotonic...`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from partrain.checkpoint import load_checkpoint
from partrain.rl import ActorCritic, Learner, LearnerServer, connect
from partrain.rl.envs import EnvRunner
from partrain.rl.learner import ACTIVE_WITHIN, ExperienceFull, StaleWeights, TrainingDone
from partrain.rl.wire import CONTENT_TYPE, Segment, decode_weights, encode_segment
from partrain.serve.protocol import HEADER, decode_infer_response, encode_request
from tests.waiting import wait_until

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_learner(**kw) -> Learner:
    torch.manual_seed(0)
    options = {"obs_shape": (4,), "num_actions": 2, "unroll": 4, "batch_segments": 1, "env": "CartPole-v1"}
    options.update(kw)
    return Learner(ActorCritic(4, 2, hidden=16), **options)


@pytest.fixture
def served() -> Iterator[tuple[Learner, str]]:
    learner = make_learner()
    server = LearnerServer(learner, token=TOKEN)
    url = server.start()
    try:
        yield learner, url
    finally:
        learner.stop()
        server.stop()


def segment(version: int, steps: int = 4, envs: int = 2) -> dict[str, torch.Tensor]:
    return {"obs": torch.zeros(steps + 1, envs, 4), "actions": torch.zeros(steps, envs, dtype=torch.int64),
            "logp": torch.full((steps, envs), math.log(0.5)), "rewards": torch.ones(steps, envs),
            "dones": torch.zeros(steps, envs), "versions": torch.full((steps, envs), version, dtype=torch.int64)}


def test_versions_are_monotonic_and_each_is_pulled_at_most_once(served):
    """A local-inference actor acts, sends and pulls while the learner trains on its segments."""
    learner, url = served
    trainer = threading.Thread(target=learner.train, kwargs={"max_frames": 12 * 4 * 3, "timeout": 120})
    trainer.start()
    runner = EnvRunner("CartPole-v1", 3, seed=1)
    with connect(url, token=TOKEN, name="a0") as actor:
        assert actor.stats.pulled_versions == [0]
        while trainer.is_alive() and actor.stats.segments < 12:
            seg, done = runner.rollout(actor.act, 4)
            assert int(seg["versions"].min()) == actor.version  # every step carries the acting version
            if not actor.send(seg, done):
                break
            actor.pull()
            actor.pull()  # unchanged (the learner trains one batch per segment): a 304, no download
        trainer.join(60)
        pulled = actor.stats.pulled_versions
        assert pulled == sorted(set(pulled)), pulled  # strictly increasing: never twice, never back
        assert actor.stats.unchanged >= actor.stats.segments  # the second pull of each round is a 304
        assert pulled[-1] <= learner.version
    runner.close()
    assert learner.version >= 2 and learner.stats.segments >= 2


def test_a_segments_answer_brings_newer_weights_so_a_pull_costs_no_request_of_its_own(served):
    learner, url = served
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:

        def post(since):
            return http.post("/rl/v1/segments", content=encode_segment(segment(learner.version), []),
                             params=None if since is None else {"weights_since": since})

        learner.publish()  # version 1
        newer = post(0)
        assert newer.status_code == 200 and newer.headers["content-type"].startswith(CONTENT_TYPE)
        state, version = decode_weights(newer.content)  # what GET /rl/v1/weights answers
        assert version == learner.version == 1 and newer.headers["etag"] == '"1"'
        assert state.keys() == learner.acting.state_dict().keys()
        assert all(torch.equal(state[k], v) for k, v in learner.acting.state_dict().items())
        assert post(1).json() == {"version": 1}  # not newer: the usual answer, no weights
        assert post(None).json() == {"version": 1}  # not asked: the usual answer
        bad = post("latest")
        assert bad.status_code == 400 and bad.json()["error"] == (
            "Expected weights_since as a version number (an integer). Received: 'latest'")
        assert learner.queue_depth == 3  # the bad request's segment was not taken

    with connect(url, token=TOKEN, name="a0") as actor:  # connecting pulls version 1
        assert actor.send(segment(1), [1.0], pull=True)
        assert (actor.stats.pulls, actor.stats.unchanged, actor.version) == (1, 1, 1)
        learner.publish()
        assert actor.send(segment(1), [], pull=True)
        assert actor.stats.pulled_versions == [1, 2] and actor.version == 2
        assert actor.send(segment(2), [])  # not asked: nothing pulled, nothing counted
        assert (actor.stats.pulls, actor.stats.unchanged, actor.stats.segments) == (2, 1, 3)


def test_central_inference_answers_equal_the_model(served):
    """Any OIP client (plain JSON here) gets the acting model's logits, a sampled action and its version."""
    learner, url = served
    obs = torch.randn(5, 4)
    request = {"inputs": [{"name": "obs", "shape": [5, 4], "datatype": "FP32", "data": obs.flatten().tolist()}]}
    r = httpx.post(f"{url}/v2/models/policy/infer", json=request, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    logits = torch.tensor(out["logits"]["data"], dtype=torch.float32).reshape(5, 2)
    with torch.inference_mode():
        want, _ = learner.acting(obs)  # the same 5 rows in one call: the same arithmetic
    assert torch.equal(logits, want)
    actions = torch.tensor(out["action"]["data"])
    logp = torch.tensor(out["logp"]["data"], dtype=torch.float32)
    assert torch.equal(logp, torch.log_softmax(want, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1))
    assert out["version"]["data"] == [learner.version] * 5

    # the binary tensor extension, through the actor's central mode
    with connect(url, token=TOKEN, mode="central") as actor:
        a, lp, version = actor.act(obs)
        assert a.shape == (5,) and version == learner.version and actor.model is None


def test_bad_requests_get_a_4xx_and_the_learner_keeps_serving(served):
    learner, url = served
    http = httpx.Client(base_url=url, timeout=30)
    infer = "/v2/models/policy/infer"

    def oip(shape, datatype="FP32"):
        body, headers = encode_request({"obs": torch.zeros(shape, dtype=torch.float64 if datatype == "FP64"
                                                            else torch.float32)}, binary=True)
        return http.post(infer, content=body, headers={**headers, **AUTH})

    assert http.get("/rl/v1/weights").status_code == 401
    assert http.get("/rl/v1/weights", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert http.post(infer, json={}).status_code == 401
    assert http.get("/v2/health/live").status_code == 200  # probes stay open
    bad_shape = oip((2, 3))
    assert bad_shape.status_code == 400 and "Expected" in bad_shape.json()["error"]
    bad_dtype = oip((2, 4), "FP64")
    assert bad_dtype.status_code == 400 and "FP32" in bad_dtype.json()["error"]
    for body in (b"not safetensors", encode_segment({**segment(0), "obs": torch.zeros(5, 2, 3)}, [])):
        r = http.post("/rl/v1/segments", content=body, headers={**AUTH, "Content-Type": CONTENT_TYPE})
        assert r.status_code == 400 and r.json()["error"].startswith("Expected"), r.text
    wrong_unroll = http.post("/rl/v1/segments", content=encode_segment(segment(0, steps=3), []), headers=AUTH)
    assert wrong_unroll.status_code == 400 and "4 steps" in wrong_unroll.json()["error"]
    # still serving: a good inference and a good segment
    good = oip((2, 4))
    assert good.status_code == 200
    assert decode_infer_response(good.content, good.headers.get(HEADER)).outputs["action"].shape == (2,)
    assert http.post("/rl/v1/segments", content=encode_segment(segment(0), [1.0]), headers=AUTH).json() == {
        "version": learner.version}
    http.close()


def test_full_queue_says_retry_later_and_stale_weights_are_told():
    learner = make_learner(max_queue=1, max_lag=2)
    server = LearnerServer(learner)
    url = server.start()
    try:
        post = lambda v: httpx.post(f"{url}/rl/v1/segments", content=encode_segment(segment(v), []),  # noqa: E731
                                    timeout=30)
        assert post(0).status_code == 200
        full = post(0)  # nobody trains: the one slot is taken
        assert full.status_code == 503 and full.headers["retry-after"] and "retry later" in full.json()["error"]
        for _ in range(3):
            learner.publish()  # three updates later, version-0 weights are 3 > max_lag behind
        stale = post(0)
        assert stale.status_code == 409 and stale.headers["x-partrain-version"] == "3"
        assert "pull the latest weights" in stale.json()["error"]
        assert learner.stats.rejected_full == 1 and learner.stats.rejected_stale == 1
        learner.finished = True
        assert post(3).status_code == 410
    finally:
        server.stop()


def test_checkpoint_resume_keeps_weights_and_versions_monotonic(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    learner = make_learner(checkpoint=path, checkpoint_every=5)
    for _ in range(7):
        learner.publish()
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(1.0)
    learner.save(path)
    resumed = make_learner(checkpoint=path, checkpoint_every=5, resume=True)
    # a crashed run reached < 5 versions past its checkpoint: 7 + 5 is beyond anything it published
    assert resumed.version == 12
    version, blob = resumed.weights()
    state, v = decode_weights(blob)
    assert version == v == 12
    for name, value in learner.model.state_dict().items():
        assert torch.equal(state[name], value)


def test_a_resume_with_another_lr_trains_with_it_and_says_so(tmp_path, caplog):
    """The optimizer state (Adam's moments) comes from the checkpoint; the lr this learner was
    given wins over the checkpoint's (it came back with the state: `--lr` on a resume did nothing)."""
    path = str(tmp_path / "ckpt.pt")
    learner = make_learner(checkpoint=path)
    opt = learner.optimizer
    for p in learner.model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    learner.save(path)
    with caplog.at_level(logging.WARNING, logger="partrain.rl"):
        resumed = make_learner(checkpoint=path, resume=True, lr=5e-4)
    assert [r.getMessage() for r in caplog.records] == [
        "resuming with this run's optimizer settings where the checkpoint's differ: lr 0.0005 (the checkpoint's 0.001)"]
    assert resumed.optimizer.param_groups[0]["lr"] == 5e-4
    for p, q in zip(learner.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], resumed.optimizer.state[q]["exp_avg"])
    caplog.clear()
    make_learner(checkpoint=path, resume=True)  # the same lr: nothing to say
    assert not caplog.records


def test_a_crash_while_checkpointing_never_lets_a_resumed_learner_reuse_a_published_version(tmp_path):
    """The every-N-th version is on disk before any actor can see it: crash inside that save, and
    the resumed learner still starts above every version the crashed one published."""
    path = str(tmp_path / "ckpt.pt")
    learner = make_learner(checkpoint=path, checkpoint_every=2)
    seg = Segment(tensors=segment(0), version=0, actor="a", episode_returns=[])
    learner._update([seg])
    learner._update([seg])  # version 2: checkpointed
    assert load_checkpoint(path)["rl"]["version"] == 2

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing the checkpoint")

    learner.save = crash
    learner._update([seg])  # version 3
    with pytest.raises(KeyboardInterrupt):
        learner._update([seg])  # would be version 4: the crash comes first
    published = learner.version
    resumed = make_learner(checkpoint=path, checkpoint_every=2, resume=True)
    assert published == 3 and resumed.version == 4 > published


def test_train_waits_for_every_actor_and_starts_its_clock_with_a_fresh_model():
    """wait_actors=2: segments before both actors have sent one are dropped (acted before the clock)."""
    learner = make_learner()
    seg = lambda actor, returns: Segment(tensors=segment(0), version=0, actor=actor,  # noqa: E731
                                        episode_returns=returns)
    learner.offer(seg("a", [1.0]))
    learner.offer(seg("b", [2.0]))  # both actors act: the clock starts when this one is taken
    learner.offer(seg("a", [3.0]))  # queued before the clock (acted by the fresh model): dropped too
    stats_box = {}
    trainer = threading.Thread(target=lambda: stats_box.update(
        st=learner.train(max_frames=2 * 4 * 2, timeout=60, wait_actors=2)))
    trainer.start()
    wait_until(lambda: learner.stats.startup_seconds > 0 and learner.queue_depth == 0, "the clock started")
    assert learner.version == 0 and learner.stats.frames == 0 and learner.stats.segments == 0
    learner.offer(seg("a", [4.0]))
    learner.offer(seg("b", [5.0]))
    trainer.join(60)
    st = stats_box["st"]
    assert st.frames == 2 * 4 * 2 and st.segments == 2 and learner.version == 2  # batch_segments=1
    assert list(st.returns) == [4.0, 5.0] and st.episodes == 2  # nothing from before the clock


def test_the_default_batch_takes_one_segment_per_acting_actor():
    """batch_segments=None: an update waits for one segment per actor that sent one in the last
    ACTIVE_WITHIN s (at least 2, at most max_queue), so the policy lag stays near one version."""
    learner = make_learner(batch_segments=None, max_queue=8)
    seg = lambda actor: Segment(tensors=segment(0), version=0, actor=actor, episode_returns=[])  # noqa: E731
    assert learner.batch_target() == 2  # nobody has sent yet
    for actor in "abc":
        learner.offer(seg(actor))
    assert learner.active_actors() == 3 and learner.batch_target() == 3
    st = learner.train(max_frames=3 * 4 * 2, timeout=60)
    assert learner.version == 1 and st.segments == 3 and len(st.lags) == 3  # one update of all three
    learner._seen["c"] -= 2 * ACTIVE_WITHIN  # "c" went quiet: it no longer counts
    assert learner.active_actors() == 2 and learner.batch_target() == 2
    capped = make_learner(batch_segments=None, max_queue=2)
    capped._seen.update(dict.fromkeys("abc", time.monotonic()))
    assert capped.active_actors() == 3 and capped.batch_target() == 2  # never more than the queue holds
    assert make_learner(batch_segments=5).batch_target() == 5  # a fixed setting wins


def test_unnamed_actors_are_told_apart(served):
    """Two connections without a name get names of their own: the learner counts both as acting."""
    learner, url = served
    with connect(url, token=TOKEN) as a, connect(url, token=TOKEN) as b:
        assert a.name and b.name and a.name != b.name
        a.send(segment(0), [])
        b.send(segment(0), [])
    assert learner.active_actors() == 2


def test_offer_nowait_queues_when_there_is_room_and_answers_none_when_full():
    """The server's first try, on its event loop: no wait, no count; the checks as `offer`'s."""
    learner = make_learner(max_queue=1, max_lag=2)
    seg = lambda v: Segment(tensors=segment(v), version=v, actor="a", episode_returns=[])  # noqa: E731
    assert learner.offer_nowait(seg(0)) == 0 and learner.queue_depth == 1
    assert learner.offer_nowait(seg(0)) is None and learner.stats.rejected_full == 0
    with pytest.raises(ExperienceFull):
        learner.offer(seg(0))
    assert learner.stats.rejected_full == 1
    for _ in range(3):
        learner.publish()
    with pytest.raises(StaleWeights):
        learner.offer_nowait(seg(0))
    learner.finished = True
    with pytest.raises(TrainingDone):
        learner.offer_nowait(seg(3))
