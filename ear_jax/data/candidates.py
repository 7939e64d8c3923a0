"""Candidate sets (Eq. (1)): per query, the top-K memories of its own bank, as a `Stream`.

Symbols: `N` queries, `K` candidates per query, `M` memories in a bank, `d` embedding dimension.

Candidates are in rank order, padded to K with `-1` and a mask when a bank is smaller. Multi-store
(Section 5): the top-K/2 of each store, ordered by score; an observation is gold when a dialogue id
it references is gold. Gold memories outside the top-K stay gold (`num_gold`). The lexical first
stages index every queried bank in one `lexical.BM25Index` (one scope per bank) and rank it with
`first_stage.bank_first_stage`, the kernel `Memory` runs too.

`load_benchmark(name, ...)` is the one entry point: load -> encode (with cache) -> candidates.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import numpy as np

from ear_jax.core import stream as stream_lib
from ear_jax.data import corpora
from ear_jax.data import corpus as corpus_lib
from ear_jax.data import encoders
from ear_jax.data import first_stage
from ear_jax.data import lexical
from ear_jax.data import synthetic

DEFAULT_K = 20
top_k_candidates = first_stage.top_k_candidates  # the dense first stage (Eq. (1))


@dataclasses.dataclass
class Benchmark:
  """Everything an EAR run needs about one benchmark (numpy arrays, query order = file order).

  Attributes:
    name: 'locomo' | 'longmemeval' | 'jsonl' | 'synthetic'.
    stream: the `Stream` of all evaluable queries.
    query_ids, query_texts: `[N]` ('' texts for synthetic).
    categories: `[N]` str, LoCoMo category / LongMemEval question_type / JSONL category.
    candidate_ids, candidate_texts: `[N, K]` str ('' = padding).
    candidate_store: `[N, K]` int8, 0 = dialogue/episodic, 1 = observation/semantic.
    candidate_scores: `[N, K]` float32 first-stage scores (-inf on padding), in rank order.
    group: `[N]` int32 index of the query's bank.
    num_gold_store: `[N, 2]` int32 gold memories of the query per store in its whole bank.
    stats: counts, exclusions, encoding statistics, Recall@K ceiling, ...
    answers: `[N]` the gold answers ('' where the file has none), or None (synthetic data).
  """
  name: str
  stream: stream_lib.Stream
  query_ids: list[str]
  query_texts: list[str]
  categories: np.ndarray
  candidate_ids: np.ndarray
  candidate_texts: np.ndarray
  candidate_store: np.ndarray
  candidate_scores: np.ndarray
  group: np.ndarray
  num_gold_store: np.ndarray
  stats: dict[str, Any]
  answers: list[str] | None = None

  @property
  def num_queries(self) -> int:
    return self.stream.num_queries

  def take(self, index) -> "Benchmark":
    """The benchmark restricted to queries `index` (an integer index array), e.g. a split."""
    index = np.asarray(index)
    return dataclasses.replace(
        self, stream=self.stream.take(index),
        query_ids=[self.query_ids[i] for i in index], query_texts=[self.query_texts[i] for i in index],
        categories=self.categories[index], candidate_ids=self.candidate_ids[index],
        candidate_texts=self.candidate_texts[index], candidate_store=self.candidate_store[index],
        candidate_scores=self.candidate_scores[index], group=self.group[index],
        num_gold_store=self.num_gold_store[index],
        answers=None if self.answers is None else [self.answers[i] for i in index])


def encoded_texts(corpus: corpus_lib.Corpus, *, multistore: bool = False
                  ) -> tuple[list[str], list[np.ndarray], list[int]]:
  """The texts `embed_corpus` encodes: every query, then the used memories of every queried bank.

  Returns:
    (texts, per bank a `[len(bank)]` bool mask of the memories encoded, offsets: bank g's rows are
    `texts[offsets[g]:offsets[g + 1]]`).
  """
  queried = {q.group for q in corpus.queries}  # banks without an evaluable query are not encoded
  used = [_used(b, multistore) if g in queried else np.zeros(len(b), bool)
          for g, b in enumerate(corpus.banks)]
  texts = [q.text for q in corpus.queries]
  offsets = [len(texts)]
  for b, u in zip(corpus.banks, used):
    texts.extend(t for t, keep in zip(b.texts, u) if keep)
    offsets.append(len(texts))
  return texts, used, offsets


def embed_corpus(corpus: corpus_lib.Corpus, encoder="minilm", *, cache_dir=None, progress=True,
                 multistore: bool = False) -> tuple[corpus_lib.EmbeddedCorpus, dict]:
  """Encodes every query and the used memories of every queried bank, once (with the disk cache).

  Banks that no evaluable query searches are left as zeros.

  Returns:
    (`ear_jax.data.corpus.EmbeddedCorpus`, encoding statistics).
  """
  enc = encoders.load_encoder(encoder)
  texts, used, offsets = encoded_texts(corpus, multistore=multistore)
  st = encoders.EncodeStats()
  t0 = time.perf_counter()
  emb = encoders.encode(enc, texts, cache_dir=cache_dir, progress=progress, stats=st)
  bank_emb = []
  for g, (b, u) in enumerate(zip(corpus.banks, used)):
    full = np.zeros((len(b), enc.dim), np.float32)
    full[u] = emb[offsets[g]:offsets[g + 1]]
    bank_emb.append(full)
  info = {"encoder": getattr(enc, "name", str(encoder)), "encoder_identity": enc.identity_hash[:16],
          "max_length": getattr(enc, "max_length", None), "dim": enc.dim,
          "encode_wall_seconds": round(time.perf_counter() - t0, 2), **dataclasses.asdict(st)}
  info["seconds"] = round(info["seconds"], 2)
  return corpus_lib.EmbeddedCorpus(corpus, bank_emb, emb[:offsets[0]]), info


def build_benchmark(ec: corpus_lib.EmbeddedCorpus, *, k: int = DEFAULT_K,
                    multistore: bool = False, candidates: str = "dense",
                    side_features: bool = False,
                    first_stage_options: first_stage.FirstStageOptions | None = None) -> Benchmark:
  """Top-K candidates, gold masks and the `Stream` for every evaluable query of an embedded corpus.

  Queries with no gold memory among the stores used are excluded (counted in `stats`).

  Args:
    k: K, candidates per query.
    multistore: top-K/2 dialogue turns + top-K/2 observations (Section 5).
    candidates: the first stage, a name in `first_stage.GENERATORS`.
    side_features: append the side features to every candidate row (`EARConfig.side_features`).
    first_stage_options: the hybrid fusion's settings.
  """
  first_stage.check_generator(candidates)
  fs_options = first_stage_options or first_stage.FirstStageOptions()
  corpus = ec.corpus
  if multistore and k % 2:
    raise ValueError(f"multi-store candidates need an even K, got {k}")
  d = ec.query_embeddings.shape[1] if ec.query_embeddings.size else (
      ec.bank_embeddings[0].shape[1] if ec.bank_embeddings else 0)
  by_group = collections.defaultdict(list)
  for n, q in enumerate(corpus.queries):
    by_group[q.group].append(n)
  nq = len(corpus.queries)
  index = np.full((nq, k), -1, np.int32)
  scores = np.full((nq, k), -np.inf, np.float32)
  gold = np.zeros((nq, k), bool)
  num_gold_store = np.zeros((nq, 2), np.int32)
  feats = np.zeros((nq, k, len(first_stage.FEATURES)), np.float32) if side_features else None
  lexical_needed = candidates != "dense" or side_features
  index_bm25, offsets, vocab = (_bm25_index(corpus, by_group, multistore) if lexical_needed
                                else (None, None, None))
  cand_ids = np.full((nq, k), "", object)
  cand_texts = np.full((nq, k), "", object)
  cand_store = np.zeros((nq, k), np.int8)
  cand_emb = np.zeros((nq, k, d), np.float32)
  for g, rows in by_group.items():
    bank = corpus.banks[g]
    used = _used(bank, multistore)
    if not lexical_needed:
      idx, sc = _dense(ec.query_embeddings[rows], ec.bank_embeddings[g], bank.stores, used, k,
                       multistore)
    else:
      queries = [lexical.term_ids(vocab, t) for t in lexical.tokenize([corpus.queries[n].text
                                                               for n in rows])]
      found = index_bm25.scores(queries, np.arange(len(corpus.banks)) == g)
      idx, sc, f = first_stage.bank_first_stage(
          ec.query_embeddings[rows], ec.bank_embeddings[g], bank.stores, used, found, k,
          candidates, fs_options, multistore, offset=offsets[g])
      if side_features:
        feats[rows] = f
    index[rows] = idx
    scores[rows] = sc
    # index -1 (padding) picks the blank row appended to each bank
    cand_ids[rows] = np.asarray([*bank.ids, ""], object)[idx]
    cand_texts[rows] = np.asarray([*(bank.texts or [""] * len(bank)), ""], object)[idx]
    cand_store[rows] = np.append(bank.stores, 0)[idx]
    cand_emb[rows] = np.concatenate([ec.bank_embeddings[g], np.zeros((1, d), np.float32)])[idx]
    for r, n in enumerate(rows):
      gm = corpus_lib.gold_mask(bank, corpus.queries[n].gold) & used
      num_gold_store[n] = [int((gm & (bank.stores == s)).sum()) for s in (0, 1)]
      gold[n] = np.append(gm, False)[idx[r]]
  mask = index >= 0
  num_gold = num_gold_store.sum(1)
  keep = np.nonzero(num_gold > 0)[0]
  strm = stream_lib.make_stream(ec.query_embeddings[keep], cand_emb[keep], mask[keep], gold[keep],
                                num_gold[keep], features=None if feats is None else feats[keep])
  stats = {**corpus.stats, "queries_without_gold_in_stores_excluded": int(nq - len(keep)),
           "queries_evaluable": int(len(keep)), "k": k, "candidates": candidates}
  if candidates == "hybrid":
    stats["first_stage_options"] = dataclasses.asdict(fs_options)
  stats["side_features"] = list(first_stage.FEATURES) if side_features else []
  stats["multistore"] = multistore
  stats["banks_smaller_than_k"] = int(sum(int(_used(b, multistore).sum()) < k
                                          for b in corpus.banks))
  bench = Benchmark(
      name=corpus.name, stream=strm,
      query_ids=[corpus.queries[n].id for n in keep],
      query_texts=[corpus.queries[n].text for n in keep],
      categories=np.asarray([corpus.queries[n].category for n in keep], dtype=object).astype(str)
      if len(keep) else np.zeros(0, str),
      # (texts stay Python strings: a fixed-width unicode array is [N, K] x the longest text,
      # gigabytes for LongMemEval_S at K = 100)
      candidate_ids=cand_ids[keep].astype(str), candidate_texts=cand_texts[keep],
      candidate_store=cand_store[keep], candidate_scores=scores[keep],
      group=np.asarray([corpus.queries[n].group for n in keep], np.int32),
      num_gold_store=num_gold_store[keep], stats=stats,
      answers=["" if corpus.queries[n].answer is None else str(corpus.queries[n].answer)
               for n in keep])
  bench.stats["retriever"] = retriever_report(bench)
  return bench


def _used(bank: corpus_lib.Bank, multistore: bool) -> np.ndarray:
  """`[M]` bool: the memories that can be candidates (single store: the dialogue turns)."""
  return np.ones(len(bank), bool) if multistore else bank.stores == corpus_lib.STORE_DIALOGUE


def _dense(queries, emb, stores, used, k: int, multistore: bool):
  """The dense first stage of one bank; with `multistore` each store's top-K/2 merged by score."""
  if not multistore:
    return top_k_candidates(queries, emb, k, valid=used)[:2]
  parts = [top_k_candidates(queries, emb, k // 2, valid=stores == s) for s in (0, 1)]
  idx = np.concatenate([p[0] for p in parts], 1)
  sc = np.concatenate([p[1] for p in parts], 1)
  order = np.argsort(-sc, axis=1, kind="stable")
  return np.take_along_axis(idx, order, 1), np.take_along_axis(sc, order, 1)


def _bm25_index(corpus: corpus_lib.Corpus, by_group, multistore: bool):
  """`(BM25Index, offsets, vocab)`: the indexed rows of every queried bank, scope = bank number.

  Bank `g`'s row `i` is document `offsets[g] + i`.
  """
  index, vocab = lexical.BM25Index(), {}
  offsets = np.concatenate([[0], np.cumsum([len(b) for b in corpus.banks])]).astype(np.int64)
  for g in sorted(by_group):
    bank = corpus.banks[g]
    if len(bank) and not any(bank.texts or ()):
      raise ValueError("the lexical first stage (bm25 / hybrid / side features) needs the "
                       "memories' texts; this bank has none (e.g. the synthetic benchmark)")
    keep = np.flatnonzero(_used(bank, multistore))
    tokens = lexical.tokenize([bank.texts[i] for i in keep])
    index.add(offsets[g] + keep, np.full(len(keep), g, np.int32),
              *lexical.pack([lexical.term_ids(vocab, t, grow=True) for t in tokens]))
  return index, offsets, vocab


def _rates(gold_top, num_gold, gold_k, s):
  n = len(num_gold)
  if n == 0:
    return {"n": 0, "recall@%d" % s: 0.0, "hitrate@%d" % s: 0.0}
  return {
      "n": int(n),
      f"recall@{s}": float(np.mean(gold_top == num_gold)) * 100,
      f"hitrate@{s}": float(np.mean(gold_top > 0)) * 100,
      # All gold inside the top-K / any: the best any reranker of the K candidates can reach.
      "recall@K_ceiling": float(np.mean(gold_k == num_gold)) * 100,
      f"recall@{s}_ceiling": float(np.mean((gold_k == num_gold) & (num_gold <= s))) * 100,
      "hitrate@K_ceiling": float(np.mean(gold_k > 0)) * 100,
      "gold_outside_top_k": int((num_gold - gold_k).sum()),
  }


def retriever_report(bench: Benchmark, s: int = 5) -> dict:
  """The frozen retriever ("Only Retriever"): top-`s` candidates, in percent.

  Recall@s = share of queries with ALL gold memories in the top s; Hitrate@s = ANY. Overall, per
  category and (multi-store) per store.
  """
  gold, num_gold = np.asarray(bench.stream.gold), np.asarray(bench.stream.num_gold)
  gold_top, gold_k = gold[:, :s].sum(1), gold.sum(1)
  rep = {"overall": _rates(gold_top, num_gold, gold_k, s), "per_category": {}}
  for c in sorted(set(bench.categories.tolist())):
    sel = bench.categories == c
    rep["per_category"][c] = _rates(gold_top[sel], num_gold[sel], gold_k[sel], s)
  if bench.stats.get("multistore"):
    rep["per_store"] = {}
    for sid, sname in ((0, "dialogue"), (1, "observation")):
      gs = gold & (bench.candidate_store == sid)
      ng = bench.num_gold_store[:, sid]
      sel = ng > 0  # queries with gold in this store
      rep["per_store"][sname] = _rates(gs[:, :s].sum(1)[sel], ng[sel], gs.sum(1)[sel], s)
    rep["observations_in_top%d_mean" % s] = float(
        (bench.candidate_store[:, :s] == 1).sum(1).mean()) if len(gold) else 0.0
  return rep


def load_benchmark(name: str, *, data_dir=None, encoder="minilm", k: int = DEFAULT_K,
                   multistore: bool = False, limit: int | None = None, cache_dir=None, seed: int = 0,
                   progress: bool = True, candidates: str = "dense", side_features: bool = False,
                   first_stage_options: first_stage.FirstStageOptions | None = None) -> Benchmark:
  """Loads, encodes (with the on-disk cache) and builds the candidate stream of a benchmark.

  Args:
    name: 'synthetic', or any name `corpora.load_corpus` takes.
    data_dir: directory of the benchmark files (else `$EAR_DATA_DIR`, else ~/.cache/ear_jax/data).
    encoder: 'minilm', a local checkpoint directory, or a `.npy`/`.npz` of embeddings.
    limit: only the first `limit` conversations / questions / queries.
    cache_dir: embedding cache root (else `$EAR_CACHE_DIR`, else ~/.cache/ear_jax).
    seed: generator seed, used by 'synthetic' only.
    k, multistore, candidates, side_features, first_stage_options: as `build_benchmark`.

  Returns:
    A `Benchmark`.
  """
  first_stage.check_generator(candidates)
  if name == "synthetic":
    kw = {} if limit is None else {"num_queries": int(limit)}
    ec = synthetic.make_synthetic(seed=seed, multistore=multistore, **kw)
    info = {"encoder": "synthetic"}
  else:
    corpus = corpora.load_corpus(name, data_dir=data_dir, limit=limit)
    ec, info = embed_corpus(corpus, encoder, cache_dir=cache_dir, progress=progress,
                            multistore=multistore)
  bench = build_benchmark(ec, k=k, multistore=multistore, candidates=candidates,
                          side_features=side_features, first_stage_options=first_stage_options)
  bench.stats["encoding"] = info
  return bench
