"""A learner restart: the learner crashes, a new one resumes from its checkpoint on the same address.

An actor process started with `subprocess` (``python -m partrain rl act URL``, as any
outside program would) acts against learner 1; learner 1 stops without a goodbye (no
410, no final checkpoint: only its periodic one is on disk, as after a SIGKILL);
learner 2 resumes from that checkpoint on the same port. The actor must reconnect on
its own and go on, saying once that the learner is away and once that it is back; the versions it acts with never go back; learner 2 starts above
every version learner 1 published and keeps training. The learners run in this
process (their versions and segments are observed directly); the actor is the outside
process.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from partrain.checkpoint import load_checkpoint
from partrain.rl import ActorCritic, Learner, LearnerServer
from tests.waiting import wait_until

pytest.importorskip("gymnasium")

EVERY = 5  # checkpoint_every


def make_learner(path: str, seed: int, resume: bool = False) -> Learner:
    torch.manual_seed(seed)
    return Learner(ActorCritic(4, 2, hidden=16), obs_shape=(4,), num_actions=2, unroll=4, batch_segments=1,
                   env="CartPole-v1", checkpoint=path, checkpoint_every=EVERY, resume=resume, seed=seed)


def record_offers(learner: Learner) -> list[int]:
    """The version of every segment the learner is offered, in arrival order (the server tries
    `offer_nowait` first and waits with `offer` when the queue is full: such a segment is listed
    twice, next to itself)."""
    versions: list[int] = []
    offer, offer_nowait = learner.offer, learner.offer_nowait

    def recording(segment, wait=0.0):  # noqa: ANN001, ANN202 - wraps Learner.offer
        versions.append(segment.version)
        return offer(segment, wait)

    def recording_nowait(segment):  # noqa: ANN001, ANN202 - wraps Learner.offer_nowait
        versions.append(segment.version)
        return offer_nowait(segment)

    learner.offer = recording  # type: ignore[method-assign]
    learner.offer_nowait = recording_nowait  # type: ignore[method-assign]
    return versions


@pytest.mark.timeout(180)
def test_actor_reconnects_to_a_learner_resumed_from_its_checkpoint(tmp_path):
    path = str(tmp_path / "checkpoint.pt")
    first = make_learner(path, seed=0)
    seen_first = record_offers(first)
    server = LearnerServer(first)
    url = server.start()
    trainer = threading.Thread(target=first.train, kwargs={"timeout": 120})
    trainer.start()
    actor = subprocess.Popen([sys.executable, "-m", "partrain", "rl", "act", url, "--num-envs", "2", "--seed", "1",
                              "--name", "a0", "--reconnect-timeout", "60"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []  # the actor's output as it comes (stdout and stderr)
    reader = threading.Thread(target=lambda: lines.extend(actor.stdout), daemon=True)
    reader.start()
    away = f"a0: no learner answers at {url} (ConnectionRefusedError); retrying for up to 60 s"
    second = None
    try:
        wait_until(lambda: first.version >= 2 * EVERY + 2 or actor.poll() is not None, "learner 1 at version 12",
                   timeout=120, interval=0.01)
        assert actor.poll() is None, actor.communicate()[0]
        # the crash: serving stops while training is still on (a finished learner would tell the
        # actor "training ended", 410), then training; no final checkpoint
        server.stop()
        first.stop()
        trainer.join(30)
        last_published = first.version
        saved = load_checkpoint(path)["rl"]
        assert saved["version"] % EVERY == 0 and saved["version"] <= last_published < saved["version"] + EVERY

        second = make_learner(path, seed=1, resume=True)  # another seed: the weights must come from the file
        assert second.version == saved["version"] + EVERY > last_published  # never a version seen before
        assert second.stats.frames == saved["frames"] > 0
        for name, value in load_checkpoint(path)["model"].items():
            assert torch.equal(second.model.state_dict()[name], value)
        resumed_at, frames_at = second.version, second.stats.frames
        seen_second = record_offers(second)
        # the actor tells its user that it waits for the learner, before one is back
        wait_until(lambda: any(away in line for line in lines) or actor.poll() is not None,
                   "the actor's line about the outage", timeout=60)
        server = LearnerServer(second, port=int(url.rsplit(":", 1)[1]))
        assert server.start() == url  # the same address: the actor knows no other
        stats = second.train(max_frames=frames_at + 12 * 8, timeout=60)  # 12 more segments of 4 x 2 frames
        assert not stats.idle and stats.frames >= frames_at + 12 * 8
        # training went on: updates after the restart, and the actor acted with their weights
        assert second.version >= resumed_at + 12
        assert seen_second and max(seen_second) > resumed_at
        # the actor's versions never went back, across the restart too
        acted = seen_first + seen_second
        assert acted == sorted(acted), acted
        assert min(v for v in seen_second if v >= resumed_at) >= resumed_at
        # learner 2 is finished: the actor is told (410) and ends on its own, status 0
        assert actor.wait(60) == 0
        reader.join(30)
        out = "".join(lines)
        assert "a0:" in out
        # one line when the outage began, one when it ended: not one per retry
        assert sum(away in line for line in lines) == 1, out
        assert sum(f"a0: the learner at {url} answers again after" in line for line in lines) == 1, out
    finally:
        first.stop()
        if second is not None:
            second.stop()
        server.stop()
        if actor.poll() is None:
            actor.kill()
            actor.wait(10)
