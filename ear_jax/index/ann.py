"""Approximate candidate search through faiss: the ANN searchers behind `Memory(index=...)`.

Symbols: `n` queries, `M` memories, `d` dimension, `K` candidates. A searcher holds one faiss index
per store and answers what the exact device search answers (top-K by inner product, ties to store
0; unfilled rows -1), optionally proposing `rerank * K` rows that the bank re-scores exactly. It is
saved as itself, not rebuilt (training and HNSW depend on batching); a stale file is rebuilt from
the table (`stale_file`). A search it cannot answer well (a small scope, an index that cannot
filter, a query short of rows) returns None and the bank searches exactly. Host-side (faiss on
the CPU): its own layer between `io` and `agent`.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import uuid
import zipfile
from typing import Callable, Optional

import numpy as np


SMALL_BATCH = 16  # fewer queries than this are searched on one thread
MAX_SELECTORS = 64  # scope selectors cached per store
FEW_ROWS = 8  # a store with at most FEW_ROWS * k rows of a query's scopes is searched exactly
STATE_FILE = "index.npz"  # a searcher's state in its directory (`FaissSearcher.save`)


def _faiss():
  try:
    import faiss  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover - faiss-cpu is in requirements.txt
    raise ImportError("an ANN index needs faiss: pip install faiss-cpu (requirements.txt)") from e
  return faiss


@contextlib.contextmanager
def _omp_threads(n: Optional[int]):
  """faiss's OpenMP threads set to `n` (None: unchanged) inside the block."""
  faiss = _faiss()
  threads = faiss.omp_get_max_threads()
  faiss.omp_set_num_threads(n or threads)
  try:
    yield
  finally:
    faiss.omp_set_num_threads(threads)


class _StoreIndex:
  """One faiss index over the vectors of one store, and their bank rows."""

  def __init__(self, make: Callable[[], object], ready: Callable[[int], bool],
               train: Optional[Callable[[object, np.ndarray], None]], dim: int):
    self._make, self._ready, self._train, self.dim = make, ready, train, dim
    self.rows = np.zeros((0,), np.int64)
    self._pending: list[np.ndarray] = []  # vectors held before an IVF is trained
    self.index = None if train is not None else make()
    self._flat = _faiss().IndexFlatIP(dim) if train is not None else None
    # scope codes -> [positions covered, bitmap [bytes] uint8, IDSelectorBitmap, vectors selected]
    self._selectors: dict[tuple[int, ...], list] = {}

  def __len__(self):
    return len(self.rows)

  @property
  def searched(self):
    """The faiss index searched now: the trained index, else the flat one of the held vectors."""
    return self.index if self.index is not None else self._flat

  def add(self, emb: np.ndarray, rows: np.ndarray) -> None:
    if not len(rows):
      return
    self.rows = np.concatenate([self.rows, rows.astype(np.int64)])
    if self.index is not None:
      self.index.add(emb)
      return
    self._pending.append(emb)
    self._flat.add(emb)
    if self._ready(len(self.rows)):  # train on everything held, then index it
      held = np.concatenate(self._pending)
      index = self._make()
      self._train(index, held)
      index.add(held)
      self.index, self._pending, self._flat = index, [], None

  def restore_state(self, data: np.ndarray, rows: np.ndarray, meta, where: str) -> None:
    """Installs a state `FaissSearcher.save` wrote; ValueError naming `where` if of another kind."""
    faiss = _faiss()
    rows = np.asarray(rows).astype(np.int64)
    try:
      index = faiss.deserialize_index(np.ascontiguousarray(data, np.uint8))
    except Exception as e:  # pylint: disable=broad-except  (faiss: a RuntimeError of C++ text)
      raise ValueError(f"{where}: faiss cannot read the saved index: {e}") from None
    trained = meta.get("trained")
    if not isinstance(trained, bool) or (not trained and self._train is None):
      raise ValueError(f"{where}: field 'trained' is {trained!r}, not a state of this index")
    want = self._make() if trained else faiss.IndexFlatIP(self.dim)
    if (type(index) is not type(want) or index.d != self.dim or index.ntotal != len(rows)
        or index.metric_type != want.metric_type or int(meta.get("ntotal", -1)) != len(rows)
        or (trained and not index.is_trained)):
      raise ValueError(f"{where}: the saved index ({type(index).__name__}, d={index.d}, "
                       f"{index.ntotal} vectors) is not a {type(want).__name__} of dimension "
                       f"{self.dim} over its {len(rows)} rows")
    self.rows = rows
    if hasattr(index, "hnsw"):  # its level generator as after drawing one level per vector held
      for _ in range(index.ntotal):
        index.hnsw.rng.rand_float()
    if trained:
      self.index, self._flat, self._pending = index, None, []
    else:  # the held vectors, float32 as added, are the flat index's
      self.index, self._flat = None, index
      self._pending = [index.reconstruct_n(0, index.ntotal)] if index.ntotal else []

  def selector(self, codes: tuple[int, ...], row_scopes: np.ndarray):
    """`(IDSelectorBitmap, count)` over this store's vectors whose bank rows' scopes are in `codes`
    (cached, and extended with the vectors added since it was built)."""
    n = len(self.rows)
    covered, bits, sel, count = self._selectors.pop(codes, None) or (0, np.zeros(0, np.uint8),
                                                                       None, 0)
    if covered < n:
      need = (n + 7) // 8
      if need > len(bits):
        bits = np.concatenate([bits, np.zeros(max(need, 2 * len(bits), 64) - len(bits), np.uint8)])
        sel = None  # (faiss reads the array in place: a new array needs a new selector)
      pos = covered + np.flatnonzero(np.isin(row_scopes[self.rows[covered:]], codes))
      np.bitwise_or.at(bits, pos >> 3, np.left_shift(1, pos & 7).astype(np.uint8))
      covered, count = n, count + len(pos)
    if sel is None:
      sel = _faiss().IDSelectorBitmap(bits)
    self._selectors[codes] = [covered, bits, sel, count]
    while len(self._selectors) > MAX_SELECTORS:
      self._selectors.pop(next(iter(self._selectors)))
    return sel, count

  def search(self, queries: np.ndarray, k: int, scopes=None):
    """`(scores [n, k] (-inf = none), rows [n, k] (-1 = none))`, only of `scopes` when given;
    None when a query got fewer than `min(k, rows of those scopes)` rows."""
    n = queries.shape[0]
    sel, count = None, len(self.rows)
    if scopes is not None and count:
      sel, count = self.selector(*scopes)
    if not count:  # nothing (of these scopes) here
      return np.full((n, k), -np.inf, np.float32), np.full((n, k), -1, np.int64)
    index = self.searched
    params = None if sel is None else _with_selector(index, sel)
    scores, ids = index.search(queries, k, params=params)
    ok = ids >= 0
    if (ok.sum(1) < min(k, count)).any():
      return None
    rows = np.where(ok, self.rows[np.maximum(ids, 0)], -1)
    return np.where(ok, scores, -np.inf).astype(np.float32), rows


class FaissSearcher:
  """Candidate search over one faiss index per store, and the scope code of every bank row.

  Args:
    dim: `d`.
    make: builds an empty faiss index of dimension `d` (inner-product metric).
    ready: `ready(vectors held)`, for indexes that need training: when to train (None: never).
    train: `train(index, vectors)` (None: the index needs no training).
    configure: `configure(index)` sets search-time parameters (e.g. efSearch / nprobe).
    build_threads: OpenMP threads for adding / training (None: faiss's default).
    rerank: the bank re-scores `rerank * K` proposed rows exactly and keeps the top K.
    name: the searcher's name in `SEARCHERS` (written with its state).
  """

  def __init__(self, dim: int, make, ready=None, train=None, configure=None,
               build_threads: Optional[int] = None, rerank: int = 1, name: str = "faiss"):
    if int(rerank) < 1:
      raise ValueError(f"rerank must be >= 1, got {rerank}")
    self.dim, self.rerank, self.build_threads = int(dim), int(rerank), build_threads
    self.name = name
    self.options: dict = {}  # the keyword options it was made with (`make_searcher`)
    self._configure = configure or (lambda index: None)
    self._new_store = lambda: _StoreIndex(make, ready, train, self.dim)
    self._stores = [self._new_store() for _ in (0, 1)]
    self.row_scopes = np.zeros((0,), np.int32)  # [rows] scope code by bank row (the selectors)
    self.state_id = uuid.uuid4().hex  # names this state; a new one after every add
    self._saved = None  # (file, state_id) last written or read
    self.stale_file = None  # the state file `load` found stale and did not use (or None)

  def __len__(self):
    return sum(len(s) for s in self._stores)

  def rows(self) -> np.ndarray:
    """`[n]` int64 the bank rows held (store 0's, then store 1's)."""
    return np.concatenate([s.rows for s in self._stores])

  def add(self, rows, emb: np.ndarray, stores: np.ndarray, scopes=None) -> None:
    """Indexes `[m, d]` unit rows with store and scope codes `[m]` (scopes None: 0); `rows [m]`
    are bank rows, ascending, each above every row held before."""
    rows = np.asarray(rows, np.int64).reshape(-1)
    if not len(rows):
      return
    emb, stores = np.ascontiguousarray(emb, np.float32), np.asarray(stores)
    if rows[-1] >= len(self.row_scopes):
      self.row_scopes = np.concatenate(
          [self.row_scopes, np.zeros(rows[-1] + 1 - len(self.row_scopes), np.int32)])
    self.row_scopes[rows] = 0 if scopes is None else scopes
    self.state_id = uuid.uuid4().hex
    with _omp_threads(self.build_threads):
      for s, store in enumerate(self._stores):
        sel = stores == s
        if sel.any():
          store.add(emb[sel], rows[sel])

  def remove(self, rows, bank) -> None:
    """Drops bank `rows`, already tombstoned in `bank`, by rebuilding from `bank`'s live rows."""
    if not np.isin(rows, self.rows()).any():
      return
    self._stores = [self._new_store() for _ in (0, 1)]
    live = np.flatnonzero(np.asarray(bank.valid))
    self.add(live, np.asarray(bank.emb[live]).astype(np.float32), np.asarray(bank.stores)[live],
             np.asarray(bank.scopes)[live])

  def search(self, queries: np.ndarray, k: int, multistore: bool,
             allowed: Optional[np.ndarray] = None):
    """Top-`k` bank rows of `[n, d]` unit queries (a few queries on one OpenMP thread).

    Args:
      queries: `[n, d]` unit queries.
      multistore: the top-`k/2` of each store instead of the dialogue memories' top-`k`.
      allowed: optional `[S]` bool over scope codes: only rows of those scopes.

    Returns:
      `(rows [n, k] int32 (-1 = none), mask [n, k] bool)`, best first; None (the caller searches
      exactly) when a query got fewer rows than it may return, or, with `allowed`, when an index
      cannot filter by scope or a store holds at most `FEW_ROWS * k` rows of those scopes.
    """
    searched = self._stores if multistore else self._stores[:1]
    per = k // len(searched)
    scopes = None
    if allowed is not None:
      scopes = (tuple(int(c) for c in np.flatnonzero(allowed)), self.row_scopes)
      stores = [store for store in searched if len(store)]
      if any(isinstance(store.searched, _faiss().IndexFastScan) for store in stores):
        return None  # (PQ fast-scan takes no ID selector)
      if any(0 < store.selector(*scopes)[1] <= FEW_ROWS * per for store in stores):
        return None  # (a few rows: the exact device search is faster and finds them all)
    queries = np.ascontiguousarray(queries, np.float32)
    for store in self._stores:
      if store.index is not None:
        self._configure(store.index)
    with _omp_threads(1 if queries.shape[0] < SMALL_BATCH else None):
      parts = [store.search(queries, per, scopes) for store in searched]
    if any(p is None for p in parts):
      return None
    scores, rows = (np.concatenate(a, 1) for a in zip(*parts))
    if multistore:  # equal scores: store 0 first
      rows = np.take_along_axis(rows, np.argsort(-scores, axis=1, kind="stable"), 1)
    mask = rows >= 0
    return np.where(mask, rows, -1).astype(np.int32), mask

  def save(self, directory) -> None:
    """Writes the state to `directory/index.npz` atomically and durably (nothing when unchanged)."""
    path = pathlib.Path(directory) / STATE_FILE
    if path.exists() and self._saved == (path, self.state_id):
      return
    arrays, stores = {}, []
    for s, store in enumerate(self._stores):  # each store's serialised index and bank rows
      arrays[f"store{s}_index"] = _faiss().serialize_index(store.searched)
      arrays[f"store{s}_rows"] = store.rows
      stores.append({"trained": store.index is not None, "ntotal": int(store.searched.ntotal)})
    meta = {"name": self.name, "options": self.options, "rows": len(self.row_scopes),
            "state_id": self.state_id, "stores": stores}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
      np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
    self._saved = (path, self.state_id)

  @staticmethod
  def load(directory, name: str, options, dim: int, rows, emb, stores, scopes) -> FaissSearcher:
    """The searcher of a table's live bank `rows [n]` (ascending; `emb [n, d]`, codes `[n]`).

    The state saved in `directory` extended with the rows added since, or a new one over all
    rows when there is none or it is stale (named in `stale_file`).

    Raises:
      ValueError: naming the file, when it is unreadable or the state of another index.
    """
    searcher = make_searcher(name, dim, options)
    rows, stores, scopes = (np.asarray(a) for a in (rows, stores, scopes))
    path, todo = pathlib.Path(directory) / STATE_FILE, np.ones(len(rows), bool)
    if path.exists():
      hint = "; remove it to rebuild the index from the table"
      try:
        with np.load(path, allow_pickle=False) as z:
          arrays = {key: z[key] for key in z.files}
        meta = json.loads(arrays.pop("meta").tobytes().decode())
        below = rows < int(meta["rows"])
      except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable index state ({type(e).__name__}: {e}){hint}") \
            from None
      if meta.get("name") != name or meta.get("options") != searcher.options:
        raise ValueError(f"{path}: the state of index {meta.get('name')!r} with options "
                         f"{meta.get('options')!r}, not {name!r} with {searcher.options!r}{hint}")
      if all(np.array_equal(arrays.get(f"store{s}_rows"), rows[below & (stores == s)])
             for s in (0, 1)):
        infos = meta.get("stores")
        try:
          if not isinstance(infos, list) or len(infos) != 2 or not all(
              isinstance(x, dict) for x in infos):
            raise ValueError(f"{path}: field 'stores' is not a list of 2 records")
          for s, (store, info) in enumerate(zip(searcher._stores, infos)):
            store.restore_state(arrays[f"store{s}_index"], arrays[f"store{s}_rows"], info,
                                f"{path} (store {s})")
        except (ValueError, KeyError) as e:
          raise ValueError(f"{e}{hint}") from None
        searcher.state_id = str(meta.get("state_id"))
        searcher.row_scopes = np.zeros(int(meta["rows"]), np.int32)
        searcher.row_scopes[rows[below]] = scopes[below]
        searcher._saved, todo = (path, searcher.state_id), ~below
      else:
        searcher.stale_file = path
    searcher.add(rows[todo], np.asarray(emb)[todo], stores[todo], scopes[todo])
    return searcher


def _with_selector(index, sel):
  """faiss search parameters with ID selector `sel` and `index`'s own search settings."""
  faiss = _faiss()
  if hasattr(index, "hnsw"):
    return faiss.SearchParametersHNSW(sel=sel, efSearch=int(index.hnsw.efSearch))
  if hasattr(index, "nprobe"):
    return faiss.SearchParametersIVF(sel=sel, nprobe=int(index.nprobe),
                                     max_codes=int(index.max_codes))
  return faiss.SearchParameters(sel=sel)


def faiss_hnsw(dim: int, *, hnsw_m: int = 32, ef_construction: int = 80,
               ef_search: int = 256, build_threads: Optional[int] = None) -> FaissSearcher:
  """HNSW (`faiss.IndexHNSWFlat`, inner product)."""
  faiss = _faiss()

  def make():
    index = faiss.IndexHNSWFlat(dim, int(hnsw_m), faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = int(ef_construction)
    return index

  def configure(index):
    index.hnsw.efSearch = int(ef_search)

  return FaissSearcher(dim, make, configure=configure, build_threads=build_threads,
                       name="faiss_hnsw")


def faiss_pq(dim: int, *, pq_m: Optional[int] = None, rerank: int = 50, train_size: int = 65536,
             build_threads: Optional[int] = None) -> FaissSearcher:
  """PQ fast-scan (`faiss.IndexPQFastScan`, `pq_m` 4-bit sub-quantizers, default `d / 2`).

  Proposes `rerank * K` rows that the bank re-scores exactly. Searched exactly until a store holds
  `train_size` vectors; the quantizer is trained on those.
  """
  faiss = _faiss()
  pq_m = dim // 2 if pq_m is None else int(pq_m)
  if pq_m < 1 or dim % pq_m:
    raise ValueError(f"pq_m={pq_m} must divide the dimension {dim}")

  return FaissSearcher(
      dim, lambda: faiss.index_factory(dim, f"PQ{pq_m}x4fs", faiss.METRIC_INNER_PRODUCT),
      ready=lambda held: held >= train_size, train=lambda index, vectors: index.train(vectors),
      build_threads=build_threads, rerank=rerank, name="faiss_pq")


def faiss_ivf(dim: int, *, nlist: int = 1024, nprobe: int = 32, train_factor: int = 39,
              kmeans_iters: int = 10, build_threads: Optional[int] = None) -> FaissSearcher:
  """IVF-Flat (`faiss.IndexIVFFlat`), trained on a store's first `train_factor * nlist` vectors."""
  faiss = _faiss()

  def make():  # the factory's index owns its flat quantizer
    return faiss.index_factory(dim, f"IVF{int(nlist)},Flat", faiss.METRIC_INNER_PRODUCT)

  def train(index, vectors):
    index.cp.niter = int(kmeans_iters)
    index.train(vectors)

  def configure(index):
    index.nprobe = int(nprobe)

  return FaissSearcher(dim, make, ready=lambda held: held >= train_factor * nlist, train=train,
                       configure=configure, build_threads=build_threads, name="faiss_ivf")


SEARCHERS: dict[str, Callable[..., FaissSearcher]] = {
    "faiss_hnsw": faiss_hnsw,
    "faiss_ivf": faiss_ivf,
    "faiss_pq": faiss_pq,
}
EXACT = "exact"  # the device search of `ear_jax.agent.memory.bank` (not a faiss searcher)
INDEXES = (EXACT,) + tuple(SEARCHERS)


def make_searcher(name: str, dim: int, options: Optional[dict] = None) -> Optional[FaissSearcher]:
  """The searcher `name` (None for 'exact'); ValueError naming the known ones or a bad option."""
  if name == EXACT:
    if options:
      raise ValueError(f"index='exact' takes no index_options, got {sorted(options)}")
    return None
  if name not in SEARCHERS:
    raise ValueError(f"unknown index {name!r}; expected one of {list(INDEXES)}")
  try:
    searcher = SEARCHERS[name](int(dim), **dict(options or {}))
  except TypeError as e:
    raise ValueError(f"bad index_options for index={name!r}: {e}") from None
  searcher.options = dict(options or {})
  return searcher
