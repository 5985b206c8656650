"""The global sample order: one stream, independent of the world size and accumulation split.

Epoch e is the permutation of all rows seeded by (seed, e); the epochs follow each other as one
stream and step k takes stream[k*G:(k+1)*G] (G = the global batch), rank r every world-th of them.
So a step's global batch is the same set of rows for any split, and the data position is a single
number (samples seen) that also resumes exactly onto another world size or global batch."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler

from llmtrain.data.formats import SAMPLE_INDEX


class GlobalOrderSampler(DistributedSampler):
    """A DistributedSampler (set_epoch, num_replicas, rank) whose iteration never ends: it starts at
    global position `start` and walks the epoch-after-epoch stream, this rank's share only."""

    def __init__(self, dataset, world_size: int, rank: int, seed: int, start: int = 0):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.start = start
        self._perms: dict[int, torch.Tensor] = {}

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(len(self.dataset),
                                                 generator=torch.Generator().manual_seed(self.seed + epoch))}
        return self._perms[epoch]

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        position = self.start + self.rank
        while True:
            epoch, offset = divmod(position, n)
            self.set_epoch(epoch)
            yield int(self.order(epoch)[offset])
            position += self.num_replicas


def step_batches(dataset, micro_batch_size: int, grad_accum_steps: int, world_size: int, rank: int,
                 seed: int, samples_seen: int = 0, collate_fn=None) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Endless iterator of steps, each a list of grad_accum_steps micro-batches for this rank, each with its
    samples' indices in the step's global batch (SAMPLE_INDEX: rank r's k-th sample of a step is r + k x world)."""
    sampler = GlobalOrderSampler(dataset, world_size, rank, seed, start=samples_seen)
    loader = iter(DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn))
    micro = micro_batch_size
    while True:
        yield [{**next(loader), SAMPLE_INDEX: rank + world_size * (i * micro + torch.arange(micro))}
               for i in range(grad_accum_steps)]
