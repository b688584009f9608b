"""An actor that partrain did not start: connect to a learner by URL, act, send (and pull).

Start a learner first:   partrain rl serve --env CartPole-v1 --port 8100 --target 475
Then run this (as many copies as you like, at any time):
                         python examples/rl_outside_actor.py http://127.0.0.1:8100 [local|central]
"""

from __future__ import annotations

import sys

import gymnasium
import numpy as np
import torch

from partrain.rl import LearnerDone, connect


def main(url: str, mode: str = "local", num_envs: int = 8) -> None:
    actor = connect(url, mode=mode, name=f"outside-{mode}")  # token=... if the learner has one
    unroll = actor.info["unroll"]  # the segment length the learner trains on
    envs = [gymnasium.make(actor.info["env"]) for _ in range(num_envs)]
    obs = torch.as_tensor(np.stack([e.reset(seed=i)[0] for i, e in enumerate(envs)]), dtype=torch.float32)
    episode = np.zeros(num_envs)
    try:
        while True:
            seg = {"obs": torch.empty(unroll + 1, num_envs, obs.shape[1]), "logp": torch.empty(unroll, num_envs),
                   "actions": torch.empty(unroll, num_envs, dtype=torch.int64),
                   "rewards": torch.empty(unroll, num_envs), "dones": torch.zeros(unroll, num_envs),
                   "versions": torch.empty(unroll, num_envs, dtype=torch.int64)}
            finished = []
            for t in range(unroll):
                seg["obs"][t] = obs
                actions, logp, version = actor.act(obs)  # local weights, or the learner's batched inference
                seg["actions"][t], seg["logp"][t], seg["versions"][t] = actions, logp, version
                nxt = []
                for i, env in enumerate(envs):
                    o, r, terminated, truncated, _ = env.step(int(actions[i]))
                    seg["rewards"][t, i], seg["dones"][t, i] = r, float(terminated)
                    episode[i] += r
                    if terminated or truncated:
                        finished.append(float(episode[i]))
                        episode[i] = 0.0
                        o, _ = env.reset()
                    nxt.append(o)
                obs = torch.as_tensor(np.stack(nxt), dtype=torch.float32)
            seg["obs"][unroll] = obs
            # with the version(s) that acted; a full queue is retried. pull: the answer brings the
            # weights when a newer version exists (each version downloaded once; same request)
            actor.send(seg, finished, pull=True)
    except LearnerDone:  # the learner finished training
        print(f"done: {actor.stats.frames} frames sent, {actor.stats.pulls} weight versions pulled")
    finally:
        actor.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
