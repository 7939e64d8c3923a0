"""A seeded synthetic benchmark with a learnable structure, for fast tests and a no-download demo.

Symbols: `d` dimension, `N` queries, `M_g` memories of bank g.

Memories are random unit vectors; a hidden rotation `A = expm(θ S)` relates queries to their gold
memories, `q = normalize(Aᵀ normalize(Σ gold m) + σ ε)`, so the raw cosine only partly finds them
while an adapter with `W ≈ A - I` can. "Look-alike" distractors near `q` itself make the raw cosine
mediocre. Bank 0 is smaller than K, so padding and masks are exercised.
"""
from __future__ import annotations

import numpy as np

from ear_jax.data import corpus as corpus_lib


def _unit(x):
  return (x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)).astype(np.float32)


def _expm_skew(s: np.ndarray) -> np.ndarray:
  """exp of a skew-symmetric matrix via its eigendecomposition (a rotation)."""
  w, v = np.linalg.eig(s)
  return np.real(v @ np.diag(np.exp(w)) @ np.linalg.inv(v))


def hidden_map(dim: int, angle: float, seed: int) -> np.ndarray:
  """The hidden rotation `A` `[d, d]` of `make_synthetic(seed=...)`."""
  rng = np.random.default_rng([seed, 1])
  g = rng.normal(size=(dim, dim))
  s = (g - g.T) / np.sqrt(2 * dim)
  return _expm_skew(angle * s).astype(np.float32)


def make_synthetic(*, seed: int = 0, num_queries: int = 500, num_banks: int = 25, dim: int = 32,
                   bank_size: tuple[int, int] = (12, 96), max_gold: int = 2, angle: float = 0.8,
                   noise: float = 0.35, lookalikes: int = 3, multistore: bool = False):
  """Generates an `EmbeddedCorpus` named 'synthetic' (no texts, no encoder needed; same seed, same).

  Args:
    num_banks: number of memory banks; query n uses bank `n % num_banks`.
    bank_size: (min, max) memories per bank (store 0); the min is below K=20 on purpose.
    max_gold: each query has 1..max_gold gold memories.
    angle: strength of the hidden rotation (0 = the raw cosine is already right).
    noise: σ, query noise.
    lookalikes: non-gold distractors per query placed near the query itself.
    multistore: also one observation (store 1) per 4 dialogue memories, gold with its source.
  """
  rng = np.random.default_rng(seed)
  a = hidden_map(dim, angle, seed)
  sizes = rng.integers(bank_size[0], bank_size[1] + 1, size=num_banks)
  sizes[0] = bank_size[0]
  bank_vecs = [list(_unit(rng.normal(size=(int(m), dim)))) for m in sizes]
  queries, q_emb = [], []
  for n in range(num_queries):
    g = n % num_banks
    vecs = bank_vecs[g]
    n_gold = int(rng.integers(1, max_gold + 1))
    gold_idx = rng.choice(int(sizes[g]), size=n_gold, replace=False)
    target = _unit(np.sum([vecs[i] for i in gold_idx], 0))
    q = _unit(a.T @ target + noise * rng.normal(size=dim) / np.sqrt(dim))
    for _ in range(lookalikes if g else 0):  # distractors near q (bank 0 stays smaller than K)
      vecs.append(_unit(q + 0.6 * rng.normal(size=dim) / np.sqrt(dim)))
    q_emb.append(q)
    queries.append(corpus_lib.Query(id=f"syn{n}", text="", gold=tuple(f"m{i}" for i in gold_idx),
                                  category=f"{n_gold}-gold", group=g))
  banks, bank_emb = [], []
  for g in range(num_banks):
    vecs = np.asarray(bank_vecs[g], np.float32)
    ids = [f"m{i}" for i in range(len(vecs))]
    stores = [0] * len(vecs)
    refs = [()] * len(vecs)
    if multistore:
      src = np.arange(0, len(vecs), 4)
      obs = _unit(vecs[src] + 0.5 * rng.normal(size=(len(src), dim)) / np.sqrt(dim))
      vecs = np.concatenate([vecs, obs], 0)
      ids += [f"o{i}" for i in src]
      stores += [1] * len(src)
      refs += [(f"m{i}",) for i in src]
    banks.append(corpus_lib.Bank(ids=ids, texts=[""] * len(ids), stores=np.asarray(stores, np.int8),
                               refs=refs))
    bank_emb.append(vecs)
  corpus = corpus_lib.Corpus(
      name="synthetic", banks=banks, queries=queries,
      stats={"queries": num_queries, "queries_evaluable": num_queries, "banks": num_banks,
             "memories": int(sum(len(b) for b in banks)), "dim": dim, "angle": angle,
             "noise": noise, "seed": seed})
  return corpus_lib.EmbeddedCorpus(corpus, bank_emb, np.asarray(q_emb, np.float32))
