"""Several sources mixed by weight (`data.mix`): each global batch draws its sequences from the
sources in the weights' proportions, deterministically, as a pure function of (seed, step), so a
resumed run (on any mesh or process count) continues the same stream.

Each source is packed, split and shuffled on its own (`data.SequenceBatches`: its own epochs).
The mixed stream is cut into blocks of M positions (whole steps, M ≥ S(S−1) for S sources), and
block b gives source s (all but the heaviest) floor((b+1)·M·w_s) − floor(b·M·w_s) of its positions,
the heaviest the rest. So after any number of whole blocks every source but the heaviest has had
floor(n·w_s) positions, never a whole sequence off its weight, and the heaviest at most S − 1 off:
the proportions after 1,000 steps are the weights to within (S − 1)/(1,000·B). Inside a block the
sources' positions are shuffled by (seed, block), so a batch is a mixture, not a run of one source.
A position's place in its source's own stream is the source's count before its block plus its rank
among the block's positions of that source: closed form, no state to checkpoint.

Configured as a mapping of a source's `data.path` (a glob of shards, a token file, ...; every
entry of the one `data.source` and tokenizer) to its weight; weights are normalised to sum 1.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from megascale_jax.config import Config
from megascale_jax.training import data

BLOCK_SEED = 0x6D6978  # the blocks' shuffles: a stream of their own beside the epochs' orders


class MixedBatches:
    """Global batches of a mixture; the interface of `data.SequenceBatches` the loop uses."""

    def __init__(self, names: list[str], sources: list[data.SequenceBatches], weights: list[float], global_batch: int):
        """`sources`: each source's stream (its `global_batch` unused: the mixture's is `global_batch`)."""
        self.names, self.sources = names, sources
        total = sum(weights)
        self.weights = np.array([w / total for w in weights])
        first = sources[0]
        self.seq_len, self.global_batch, self.seed, self.split = first.seq_len, global_batch, first.seed, first.split
        self.n_train = sum(s.n_train for s in sources)
        # The heaviest source takes each block's rounding: floor(M·w) of every other source leaves
        # it at least M·w_max − (S − 1) ≥ 0 positions when M ≥ S(S − 1), since w_max ≥ 1/S.
        self._rest = int(np.argmax(self.weights))
        count = len(sources)
        self.block = self.global_batch * max(1, math.ceil(count * (count - 1) / self.global_batch))
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def counts_before(self, block: int) -> np.ndarray:
        """Positions each source has had in the blocks before `block`."""
        n = block * self.block
        counts = np.floor(n * self.weights + 1e-9).astype(np.int64)  # 1e-9: 0.7 × 10 is 6.999...
        counts[self._rest] = 0
        counts[self._rest] = n - counts.sum()
        return counts

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """The block's (source of each position, the position's place in its source's stream)."""
        if block not in self._blocks:
            before, after = self.counts_before(block), self.counts_before(block + 1)
            slots = np.repeat(np.arange(len(self.sources)), after - before)
            slots = np.random.default_rng([self.seed, BLOCK_SEED, block]).permutation(slots)
            places = np.empty(self.block, dtype=np.int64)
            for s in range(len(self.sources)):
                mine = np.flatnonzero(slots == s)
                places[mine] = before[s] + np.arange(len(mine))
            self._blocks = {b: v for b, v in self._blocks.items() if b == block - 1}  # a step spans at most two
            self._blocks[block] = (slots, places)
        return self._blocks[block]

    def streams(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, position in that source's stream) of each position of the mixed stream."""
        sources, places = np.empty(len(positions), np.int64), np.empty(len(positions), np.int64)
        blocks, offsets = np.divmod(positions, self.block)
        for b in np.unique(blocks):
            slots, within = self._block(int(b))
            here = blocks == b
            sources[here], places[here] = slots[offsets[here]], within[offsets[here]]
        return sources, places

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of step `step`'s global batch: int32, shape (stop-start, seq_len+1)."""
        sources, places = self.streams(np.arange(step * self.global_batch + start, step * self.global_batch + stop))
        out = np.empty((stop - start, self.seq_len + 1), dtype=np.int32)
        for s in np.unique(sources):
            out[sources == s] = self.sources[s].rows_at(places[sources == s])
        return out

    def realised(self, steps: int) -> dict[str, float]:
        """Each source's share of the sequences of the first `steps` steps."""
        n = steps * self.global_batch
        if n == 0:
            return {name: 0.0 for name in self.names}
        block, offset = divmod(n, self.block)
        counts = self.counts_before(block) + np.bincount(self._block(block)[0][:offset], minlength=len(self.sources))
        return {name: float(c) / n for name, c in zip(self.names, counts)}

    def record_fields(self, steps: int) -> dict:
        return {"data_mix": {name: round(share, 6) for name, share in self.realised(steps).items()}}


@dataclasses.dataclass(frozen=True)
class Mixture:
    train: MixedBatches
    val: MixedBatches
    corpus: data.Corpus  # the first source's (its tokenizer and end-of-document token are every source's)
    description: str


def load(cfg: Config) -> Mixture:
    """Each `data.mix` source loaded as `data.path` would be, packed and split on its own."""
    names, corpora = list(cfg.data.mix), []
    for path in names:
        one = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=path, mix=None))
        try:
            corpora.append(data.load_corpus(one))
        except data.DataError as e:
            raise data.DataError(f"data.mix source {path!r}: {e}") from None
    weights = [cfg.data.mix[name] for name in names]
    splits = {}
    for split in ("train", "val"):
        sources = []
        for name, corpus in zip(names, corpora):
            # A source needs one sequence, not a batch of its own: batches mix them (global_batch 1).
            try:
                sources.append(data.SequenceBatches(corpus.tokens, cfg.model.seq_len, split, cfg.data.val_fraction,
                                                    cfg.train.seed, 1))
            except data.DataError as e:
                raise data.DataError(f"data.mix source {name!r}: {e}") from None
        splits[split] = MixedBatches(names, sources, weights, cfg.train.global_batch)
    train = splits["train"]
    description = "; ".join(f"{name} (weight {w:.3g}): {c.description}, {s.n_train:,} training sequences"
                            for name, w, c, s in zip(names, train.weights, corpora, train.sources))
    return Mixture(train, splits["val"], corpora[0], description)
