"""Reinforcement learning with one agent and several observers over RPC (REINFORCE).

The classic torch.distributed.rpc RL program, written for rrefrt. The agent (rank 0) owns
the policy network and creates one ``Observer`` on every other rank with ``rpc.remote``.
Each episode it asks all observers, in parallel, to play; an observer steps its own
environment and, at every step, calls back into the agent through an RRef
(``agent_rref.rpc_sync().select_action(...)``) to pick an action and to report the
reward. When all observers are done the agent updates its policy from the collected
rewards. The environment is a small random one (no gym, no downloads): the state is a
random vector and the reward is 1 when the action matches the sign of its first entry.

The same file runs on torch.distributed.rpc (``--backend torch`` or RPC_BACKEND=torch)::

    python examples/rl_agent_observers.py [--backend rrefrt|torch] [--world-size 3]
    rrefrt-run --nproc-per-node 3 examples/rl_agent_observers.py
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading


def _backend() -> str:
    for i, a in enumerate(sys.argv):
        if a.startswith("--backend="):
            return a.split("=", 1)[1]
        if a == "--backend" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
    return os.environ.get("RPC_BACKEND", "rrefrt")


BACKEND = _backend()
os.environ["RPC_BACKEND"] = BACKEND  # spawned workers import this module again

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributions import Categorical  # noqa: E402

if BACKEND == "torch":
    import torch.distributed.rpc as rpc
else:
    import rrefrt as rpc

STATE_DIM = 4


class RandomEnv:
    """Random states; reward 1 for action 1 when state[0] > 0, for action 0 otherwise."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.state = torch.zeros(STATE_DIM)

    def reset(self) -> torch.Tensor:
        self.state = torch.randn(STATE_DIM, generator=self.gen)
        return self.state

    def step(self, action: int) -> tuple[torch.Tensor, float]:
        reward = 1.0 if action == int(self.state[0] > 0) else 0.0
        self.state = torch.randn(STATE_DIM, generator=self.gen)
        return self.state, reward


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(STATE_DIM, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.net(x), dim=-1)


def _call_method(method, rref, *args, **kwargs):
    """Run ``method`` on the object ``rref`` refers to (on its owner)."""
    return method(rref.local_value(), *args, **kwargs)


class Observer:
    def __init__(self) -> None:
        self.id = rpc.get_worker_info().id
        self.env = RandomEnv(seed=self.id)

    def run_episode(self, agent_rref, n_steps: int) -> None:
        state = self.env.reset()
        for _ in range(n_steps):
            action = agent_rref.rpc_sync().select_action(self.id, state)
            state, reward = self.env.step(action)
            agent_rref.rpc_sync().report_reward(self.id, reward)


class Agent:
    def __init__(self, world_size: int, lr: float) -> None:
        torch.manual_seed(0)
        self.ob_rrefs = [rpc.remote(f"observer{r}", Observer) for r in range(1, world_size)]
        self.agent_rref = rpc.RRef(self)
        self.policy = Policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=lr)
        self.lock = threading.Lock()
        self.log_probs: dict[int, list[torch.Tensor]] = {}
        self.rewards: dict[int, list[float]] = {}

    def select_action(self, ob_id: int, state: torch.Tensor) -> int:
        probs = self.policy(state.unsqueeze(0))
        m = Categorical(probs)
        action = m.sample()
        with self.lock:
            self.log_probs.setdefault(ob_id, []).append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id: int, reward: float) -> None:
        with self.lock:
            self.rewards.setdefault(ob_id, []).append(reward)

    def run_episode(self, n_steps: int) -> None:
        futs = [
            rpc.rpc_async(ob_rref.owner(), _call_method,
                          args=(Observer.run_episode, ob_rref, self.agent_rref, n_steps))
            for ob_rref in self.ob_rrefs
        ]
        for fut in futs:
            fut.wait()

    def finish_episode(self, gamma: float = 0.9) -> float:
        """One REINFORCE step over every observer's trajectory; returns the mean reward."""
        log_probs, returns, total, count = [], [], 0.0, 0
        for ob_id, rewards in self.rewards.items():
            ret, rets = 0.0, []
            for r in reversed(rewards):
                ret = r + gamma * ret
                rets.insert(0, ret)
            returns.extend(rets)
            log_probs.extend(self.log_probs[ob_id])
            total, count = total + sum(rewards), count + len(rewards)
        r = torch.tensor(returns)
        r = (r - r.mean()) / (r.std() + 1e-6)
        loss = -(torch.cat(log_probs) * r).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.log_probs, self.rewards = {}, {}
        return total / count


def run_agent(world_size: int, args: argparse.Namespace) -> None:
    agent = Agent(world_size, lr=args.lr)
    means = []
    for _ in range(args.episodes):
        agent.run_episode(args.steps)
        means.append(agent.finish_episode())
    print(f"[{BACKEND}] {world_size - 1} observers, {args.episodes} episodes: mean reward "
          + " ".join(f"{m:.2f}" for m in means))
    assert len(means) == args.episodes and all(0.0 <= m <= 1.0 for m in means), means
    print("rl_agent_observers: OK")


def run_worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60)
    name = "agent" if rank == 0 else f"observer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        run_agent(world_size, args)
    rpc.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["rrefrt", "torch"], default=BACKEND)
    p.add_argument("--world-size", type=int, default=3, help="1 agent + N-1 observers")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.02)
    args = p.parse_args()
    if "RANK" in os.environ:  # one rank of a job started by a launcher
        run_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    mp.spawn(run_worker, args=(args.world_size, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
