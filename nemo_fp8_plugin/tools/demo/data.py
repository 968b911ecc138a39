"""The demo's embedded corpus: the Python standard library's own source, byte-level.

Every machine that runs the demo has it, so nothing is downloaded and no data ships with
the package. The files are read in sorted order up to a byte budget, so a given Python
version always yields the same corpus.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

__all__ = ["stdlib_corpus", "ByteBatches"]


def stdlib_corpus(max_bytes: int = 2_000_000) -> torch.Tensor:
    """uint8 tokens of the standard library's top-level ``*.py`` files (sorted), up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"\n".join(chunks)[:max_bytes]
    if len(blob) < 100_000:
        raise RuntimeError(f"the standard library at {root} holds too little source for the demo")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


class ByteBatches:
    """Random windows of a token stream: a train split and a fixed held-out eval set.

    The last ``eval_fraction`` of the corpus is held out; eval batches are drawn once from
    it so every arm is scored on exactly the same tokens.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_length: int,
        batch_size: int,
        seed: int,
        eval_fraction: float = 0.1,
        eval_batches: int = 4,
    ):
        split = int(len(tokens) * (1 - eval_fraction))
        self.train, self.held_out = tokens[:split].long(), tokens[split:].long()
        self.seq_length, self.batch_size, self.seed = seq_length, batch_size, seed
        gen = torch.Generator().manual_seed(seed + 1)
        self.eval = [self._window(self.held_out, gen) for _ in range(eval_batches)]

    def _window(self, source: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(
            0, len(source) - self.seq_length - 1, (self.batch_size,), generator=gen
        )
        return torch.stack([source[s : s + self.seq_length + 1] for s in starts.tolist()])

    def train_batches(self, steps: int):
        """``steps`` training batches [batch, seq+1], the same sequence for every arm."""
        gen = torch.Generator().manual_seed(self.seed)
        for _ in range(steps):
            yield self._window(self.train, gen)
