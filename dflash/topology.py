"""Which rank does what: drafter ranks first (so rank 0, which prints progress, sees the loss), then
target ranks; target rank t feeds drafter t mod D; each drafter's producers get fixed batch quotas."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from dflash.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class Topology:
    num_targets: int
    """Target ranks T."""
    num_drafters: int
    """Drafter ranks D; ranks 0..D-1."""

    @property
    def world_size(self) -> int:
        return self.num_targets + self.num_drafters

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(self.num_drafters))

    @property
    def target_ranks(self) -> list[int]:
        return list(range(self.num_drafters, self.world_size))

    def role(self, rank: int) -> str:
        return "drafter" if rank < self.num_drafters else "target"

    def target_index(self, rank: int) -> int:
        """0..T-1 for a target rank: its data shard."""
        return rank - self.num_drafters

    def drafter_of(self, target_rank: int) -> int:
        return self.target_index(target_rank) % self.num_drafters

    def producers_of(self, drafter_rank: int) -> list[int]:
        return [t for t in self.target_ranks if self.drafter_of(t) == drafter_rank]

    def quota(self, target_rank: int, drafter_steps: int) -> int:
        """Batches this target sends in total: its drafter's steps split evenly among its producers."""
        producers = self.producers_of(self.drafter_of(target_rank))
        i = producers.index(target_rank)
        base, extra = divmod(drafter_steps, len(producers))
        return base + (1 if i < extra else 0)


def host_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads(topo: Topology, rank: int, cores: int, waits_asleep: bool) -> int:
    """Intra-op threads of a CPU rank: an equal share of `cores`; but when OpenMP's waiting threads sleep,
    each drafter (the bound stage: forward and backward) takes a share of all the cores."""
    if waits_asleep and topo.role(rank) == "drafter":
        return max(1, cores // topo.num_drafters)
    return max(1, cores // topo.world_size)


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """torch's intra-op threads set to `n` inside (None: left as they are), restored after."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def resolve_topology(cfg: TrainConfig, world: int) -> Topology:
    """The run's Topology for `world` ranks: the counts given, the other one the rest of the world;
    neither given: drafters max(1, world // 3) (one of each on two ranks). ConfigError for none."""
    t, d = cfg.parallel.target_gpus, cfg.parallel.drafter_gpus
    if t is None and d is None:
        d = max(1, world // 3)
    t = world - d if t is None else t
    d = world - t if d is None else d
    topo = Topology(t, d)
    if topo.world_size != world or topo.num_targets < 1 or topo.num_drafters < 1:
        raise ConfigError(f"--target-gpus/--drafter-gpus: {t} + {d} ranks do not make a world of {world}")
    if topo.num_drafters > topo.num_targets:
        raise ConfigError(f"--drafter-gpus: {topo.num_drafters} drafters but only {topo.num_targets} "
                          "targets; every drafter needs at least one target feeding it")
    return topo
