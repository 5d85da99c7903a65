"""A PPO-style RL loop: no-grad rollouts between updates, a value loss that rises.

Shape: the usual hand-written actor-critic loop -- every update first
collects ``--rollout-len`` environment steps under ``torch.no_grad()`` (the
policy acts in a toy vectorised environment, no DataLoader), then runs
``--epochs`` PPO epochs of clipped policy loss + value loss + entropy bonus
on DDP. Rewards grow as the policy learns and the returns are not
normalised, so the value loss rises for a long stretch of a healthy run
(as it does in real PPO runs); the episode return is all-reduced for the log.

Ranks: any world size (tested with 2). Backend: gloo on CPU.
"""

import argparse
import gc
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

OBS, ACTIONS, ENVS = 8, 4, 16


class ToyEnv:
    """Reward for the action matching a hidden function of the observation, growing with the step count."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(OBS, ACTIONS, generator=torch.Generator().manual_seed(7))
        self.t = 0
        self.obs = torch.randn(ENVS, OBS, generator=self.g)

    def step(self, action):
        best = (self.obs @ self.w).argmax(1)
        self.t += 1
        reward = (action == best).float() * (1.0 + self.t / 200.0)  # returns grow over training
        self.obs = torch.randn(ENVS, OBS, generator=self.g)
        return self.obs, reward


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(OBS, 64), nn.Tanh())
        self.pi = nn.Linear(64, ACTIONS)
        self.v = nn.Linear(64, 1)

    def forward(self, obs):
        h = self.body(obs)
        return self.pi(h), self.v(h).squeeze(-1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (PPO epochs x updates)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollout-len", type=int, default=64)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--act-sleep", type=float, default=0.0, help="extra seconds per environment step")
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(ActorCritic())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    env = ToyEnv(args.seed + rank)
    obs = env.obs
    step, value_loss = 0, float("nan")
    while step < args.steps:
        # Rollout: the policy acts, no gradients.
        buf_obs, buf_act, buf_logp, buf_ret = [], [], [], []
        with torch.no_grad():
            for _ in range(args.rollout_len):
                logits, _ = model.module(obs)
                dist_a = torch.distributions.Categorical(logits=logits)
                action = dist_a.sample()
                buf_obs.append(obs)
                buf_act.append(action)
                buf_logp.append(dist_a.log_prob(action))
                obs, reward = env.step(action)
                buf_ret.append(reward)
                if args.act_sleep:
                    time.sleep(args.act_sleep)
        obs_b, act_b, logp_b = torch.cat(buf_obs), torch.cat(buf_act), torch.cat(buf_logp)
        ret = torch.stack(buf_ret)
        ret = torch.flip(torch.cumsum(torch.flip(ret, [0]), 0), [0]).reshape(-1)  # undiscounted returns-to-go
        with torch.no_grad():
            _, v_old = model.module(obs_b)
            adv = ret - v_old
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        for _ in range(args.epochs):
            logits, v = model(obs_b)
            d = torch.distributions.Categorical(logits=logits)
            ratio = torch.exp(d.log_prob(act_b) - logp_b)
            policy_loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
            vloss = nn.functional.mse_loss(v, ret)  # unnormalised returns: rises as they grow
            loss = policy_loss + 0.5 * vloss - 0.01 * d.entropy().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            value_loss = vloss.item()
            step += 1
            if args.sleep:
                time.sleep(args.sleep)
            if step >= args.steps:
                break
        mean_ret = torch.tensor([ret.mean().item()])
        dist.all_reduce(mean_ret)
        if rank == 0 and step % 20 < args.epochs:
            print(f"step {step} return {mean_ret.item() / dist.get_world_size():.2f} value_loss {value_loss:.3f}",
                  flush=True)
    if rank == 0:
        print(f"done: steps={step} final_loss={value_loss:.4f}", flush=True)
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
