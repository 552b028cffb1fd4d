"""Per-request sampling. Each request draws from its own generator, seeded by (trial seed, request id),
so the tokens a request gets do not depend on which other requests shared its batches, nor on
preemption (a recomputed sequence never re-samples a token it already has)."""
from __future__ import annotations

import torch

from ....config import SamplingConfig
from ....sampling import is_greedy, sample


class Sampler:
    def __init__(self, spec: SamplingConfig, seed: int, device: torch.device):
        self.spec, self.seed, self.device = spec, seed, device
        self._generators: dict[int, torch.Generator] = {}  # the only RNG state, one per live request

    def sample(self, seq_ids: list[int], logits: torch.Tensor) -> list[int]:
        """logits [R, V] of the sequences `seq_ids` (in order) -> one token id each."""
        if is_greedy(self.spec):
            return logits.argmax(dim=-1).tolist()
        out = []
        for i, sid in enumerate(seq_ids):
            gen = self._generators.get(sid)
            if gen is None:
                gen = self._generators[sid] = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + sid)
            out.append(int(sample(logits[i:i + 1], self.spec, gen)[0]))
        return out

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
