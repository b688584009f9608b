"""`EnvRunner.rollout` against a hand-written gymnasium loop: the same observations, rewards,
ends and episode returns, step by step (CartPole-v1, 3 environments, episodes that end inside
the segment)."""

from __future__ import annotations

import gymnasium
import numpy as np
import torch

from partrain.rl.envs import EnvRunner


def pattern(t: int, i: int) -> int:
    return (t // 3 + i) % 2  # runs of three pushes the same way: episodes of ~10-40 steps


def test_rollout_equals_a_hand_written_gymnasium_loop():
    envs, steps, seed = 3, 60, 7
    runner = EnvRunner("CartPole-v1", envs, seed=seed)
    clock = {"t": 0}

    def act(obs):
        t = clock["t"]
        clock["t"] += 1
        actions = torch.tensor([pattern(t, i) for i in range(envs)])
        return actions, torch.full((envs,), -0.5), 4

    segment, finished = runner.rollout(act, steps)
    runner.close()

    by_hand = [gymnasium.make("CartPole-v1") for _ in range(envs)]
    obs = [e.reset(seed=seed + i)[0] for i, e in enumerate(by_hand)]
    returns, ended = [0.0] * envs, []
    want_obs, want_rewards, want_dones = [np.stack(obs)], [], []
    for t in range(steps):
        rewards, dones = [], []
        for i, e in enumerate(by_hand):
            o, r, terminated, truncated, _ = e.step(pattern(t, i))
            returns[i] += r
            rewards.append(r)
            dones.append(1.0 if terminated else 0.0)
            if terminated or truncated:
                ended.append(returns[i])
                returns[i] = 0.0
                o, _ = e.reset()
            obs[i] = o
        want_obs.append(np.stack(obs))
        want_rewards.append(rewards)
        want_dones.append(dones)

    assert torch.equal(segment["obs"], torch.tensor(np.stack(want_obs), dtype=torch.float32))
    assert torch.equal(segment["rewards"], torch.tensor(want_rewards, dtype=torch.float32))
    assert torch.equal(segment["dones"], torch.tensor(want_dones, dtype=torch.float32))
    assert segment["dones"].sum() >= 3  # episodes did end inside the segment
    assert finished == ended
    assert torch.equal(segment["actions"], torch.tensor([[pattern(t, i) for i in range(envs)] for t in range(steps)]))
    assert torch.equal(segment["versions"], torch.full((steps, envs), 4))
    assert segment["rewards"].dtype == segment["dones"].dtype == torch.float32
    assert runner.frames == steps * envs


def test_sampled_actions_follow_the_softmax_and_carry_their_log_probability():
    from partrain.rl.envs import sample_actions

    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]]).repeat(40_000, 1)
    actions, logp = sample_actions(logits, torch.Generator().manual_seed(3))
    want = torch.softmax(logits[0], -1)
    freq = torch.bincount(actions, minlength=4).double() / len(actions)
    # 40,000 draws: each frequency's standard deviation is at most 0.0025; a fixed seed, so the
    # same draws on any machine, and 0.01 is four of them
    assert torch.allclose(freq, want.double(), atol=0.01), (freq, want)
    assert torch.equal(logp, torch.log_softmax(logits, -1).gather(-1, actions[:, None]).squeeze(-1))
    assert actions.dtype == torch.int64 and actions.shape == (40_000,)
    again, _ = sample_actions(logits, torch.Generator().manual_seed(3))
    assert torch.equal(actions, again)  # the generator decides


class _Grid(gymnasium.Env):
    """Observations of shape (2, 3) (an image-like box): the step count and the action in every cell."""

    observation_space = gymnasium.spaces.Box(-10.0, 10.0, (2, 3), dtype=np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros((2, 3), dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        obs = np.full((2, 3), self.t, dtype=np.float32)
        obs[1] = int(action)
        return obs, 1.0, self.t == 3, False, {}


def test_observations_of_several_dims_are_flattened_row_by_row():
    gymnasium.register("PartrainTestGrid-v0", entry_point=_Grid)
    runner = EnvRunner("PartrainTestGrid-v0", 2, seed=0)
    segment, finished = runner.rollout(lambda obs: (torch.tensor([0, 1]), torch.zeros(2), 0), 4)
    t = [0, 1, 2, 0, 1]  # the step count seen at each of the 5 observations: an episode ends after 3 steps
    want = torch.tensor([[[t[k]] * 3 + [0] * 3, [t[k]] * 3 + [1 if t[k] else 0] * 3] for k in range(5)],
                        dtype=torch.float32)
    assert segment["obs"].shape == (5, 2, 6)
    assert torch.equal(segment["obs"], want)
    assert torch.equal(runner.obs, want[-1])
    assert finished == [3.0, 3.0]
