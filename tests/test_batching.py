"""Micro-batching of concurrent `Memory` calls (`ear_jax/agent/memory/batcher.py`,
`MemoryConfig.batch_window_ms`): batched answers equal unbatched ones, a bad request fails alone,
writes stay consistent."""
import hashlib
import threading
import time

import numpy as np
import pytest

from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.agent.memory import batcher as batcher_lib
from ear_jax.data import encoder_base
from tests.memory_helpers import D, config


class _HashEncoder(encoder_base.Encoder):
  """A deterministic fake encoder: each text's unit vector from its hash; 'BOOM' in a text makes
  the call fail (as a tokenizer error would); counts calls and the texts per call."""
  name, dim = "hash", D

  def __init__(self):
    self.calls = []

  @property
  def identity(self) -> dict:
    return {"hash": D}

  def encode_new(self, texts, progress=True, bar=None):
    del progress, bar
    self.calls.append(len(texts))
    if any("BOOM" in t for t in texts):
      raise ValueError("the encoder cannot encode 'BOOM'")
    rows = [np.random.default_rng(int(hashlib.sha256(t.encode()).hexdigest()[:8], 16))
            .normal(size=D) for t in texts]
    return encoder_base.unit_rows(np.asarray(rows, np.float32), "hash"), 0


def _memory(window_ms: float, **kw) -> Memory:
  mem = Memory(MemoryConfig(encoder=None, config=config(), batch_window_ms=window_ms, **kw),
               encoder=_HashEncoder())
  for scope in ("a", "b"):
    mem.add([f"{scope} memory {i}" for i in range(12)], scope=scope,
            ids=[f"{scope}{i}" for i in range(12)])
  return mem


def _together(fns):
  """Runs `fns` in threads released at once; `[value or exception]` in order."""
  out, start = [None] * len(fns), threading.Barrier(len(fns))

  def run(i):
    start.wait()
    try:
      out[i] = fns[i]()
    except Exception as e:  # pylint: disable=broad-except
      out[i] = e
  threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(10)
  return out


def _same_slate(x, y):
  assert x.ids == y.ids and x.query == y.query
  np.testing.assert_allclose(x.scores, y.scores, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# the batcher alone (no device calls)


def _echo_batcher(window=0.05, max_queries=64, searches=None):
  def encode(texts, what):
    if any(t == "bad" for t in texts):
      raise ValueError(f"cannot encode {what} 'bad'")
    return np.asarray([[float(len(t))] for t in texts])

  def search(key, texts, queries, scopes):
    if searches is not None:
      searches.append((key, list(texts), list(scopes)))
    if key == "broken" and len(texts) > 1:
      raise RuntimeError("this search fails on more than one query")
    return queries * 10, None

  return batcher_lib.Batcher(window, max_queries, encode, search, threading.RLock())


def _request(text, key="k", prepare=None, scope=None):
  return batcher_lib.Request([text], None, key, [text], prepare,
                             lambda texts, emb, out: (texts[0], float(out[0][0, 0])),
                             scope=scope)


def test_a_window_shares_one_encoder_call_and_one_search_per_key():
  searches = []
  b = _echo_batcher(searches=searches)
  got = _together([lambda t=t, k=k: b.submit(_request(t, k))
                   for t, k in (("x", "k1"), ("yy", "k1"), ("zzz", "k2"), ("wwww", "k1"))])
  assert got == [("x", 10.0), ("yy", 20.0), ("zzz", 30.0), ("wwww", 40.0)]
  counts = b.counts()
  assert counts["batch_windows"] == 1 and counts["batch_encoder_calls"] == 1
  assert sorted(k for k, _, _ in searches) == ["k1", "k2"] and counts["batch_searches"] == 2


def test_requests_of_different_scopes_share_one_search_each_with_its_scope():
  searches = []
  b = _echo_batcher(searches=searches)
  got = _together([lambda t=t, s=s: b.submit(_request(t, scope=s))
                   for t, s in (("x", ("a",)), ("yy", ("b",)), ("zzz", None))])
  assert got == [("x", 10.0), ("yy", 20.0), ("zzz", 30.0)]
  assert len(searches) == 1 and b.counts()["batch_searches"] == 1
  _, texts, scopes = searches[0]
  assert dict(zip(texts, scopes)) == {"x": ("a",), "yy": ("b",), "zzz": None}


def test_a_bad_request_fails_alone_in_its_window():
  def refuse():
    raise ValueError("k=9 is larger than the memory bank")
  b = _echo_batcher()
  got = _together([lambda: b.submit(_request("x")), lambda: b.submit(_request("bad")),
                   lambda: b.submit(_request("yy", prepare=refuse)),
                   lambda: b.submit(_request("zzz"))])
  assert got[0] == ("x", 10.0) and got[3] == ("zzz", 30.0)
  assert isinstance(got[1], ValueError) and "cannot encode query 'bad'" in str(got[1])
  assert isinstance(got[2], ValueError) and "larger than the memory bank" in str(got[2])


def test_a_failing_search_is_retried_one_request_at_a_time():
  b = _echo_batcher()
  got = _together([lambda: b.submit(_request("x", "broken")),
                   lambda: b.submit(_request("yy", "broken"))])
  assert got == [("x", 10.0), ("yy", 20.0)]


def test_a_full_window_closes_before_its_time():
  b = _echo_batcher(window=30.0, max_queries=2)
  t = time.perf_counter()
  got = _together([lambda: b.submit(_request("x")), lambda: b.submit(_request("yy"))])
  assert got == [("x", 10.0), ("yy", 20.0)] and time.perf_counter() - t < 10.0


def test_an_encode_only_request_gets_its_embeddings():
  b = _echo_batcher()
  emb = b.submit(batcher_lib.Request(["abc", "de"], None, None, what="memory"))
  np.testing.assert_array_equal(emb, [[3.0], [2.0]])


# ------------------------------------------------------------------------------------------------
# through Memory


def test_window_zero_is_the_unbatched_memory():
  mem = Memory(MemoryConfig(encoder=None, config=config()))
  assert mem._stage.batcher is None  # pylint: disable=protected-access
  assert "batch_windows" not in mem.stats
  mem = Memory(MemoryConfig(encoder=None, config=config(), batch_window_ms=2.0))
  assert mem.stats["batch_windows"] == 0


@pytest.mark.parametrize("bad, error", [(-1.0, ValueError), (float("nan"), ValueError),
                                        (True, TypeError), ("5", TypeError)])
def test_batch_window_must_be_a_number_of_milliseconds(bad, error):
  with pytest.raises(error, match="batch_window_ms"):
    MemoryConfig(encoder=None, config=config(), batch_window_ms=bad)


def test_batching_is_not_part_of_what_a_memory_is():
  a = MemoryConfig(encoder=None, config=config())
  b = MemoryConfig(encoder=None, config=config(), batch_window_ms=3.0, batch_max_queries=8)
  assert a._comparable() == b._comparable()  # pylint: disable=protected-access


@pytest.mark.slow
def test_concurrent_searches_get_each_their_own_unbatched_answer():
  plain, batched = _memory(0.0), _memory(50.0)
  asks = [("a memory 3", "a", 3), ("b memory 5", "b", 2), ("a memory 7", None, 4),
          ("something else", "b", 3), ("a memory 1", ["a", "b"], 5), ("b memory 0", "b", 3)]
  got = _together([lambda q=q, s=s, k=k: batched.search(q, k, scope=s) for q, s, k in asks])
  for (q, s, k), slate in zip(asks, got):
    _same_slate(slate, plain.search(q, k, scope=s))
  stats = batched.stats
  assert stats["batch_encoder_calls"] < len(asks) and stats["batch_windows"] < len(asks)


@pytest.mark.slow
@pytest.mark.parametrize("candidates", ["dense", "hybrid"])
def test_a_window_of_several_scopes_is_one_search(candidates):
  plain = _memory(0.0, candidates=candidates)
  batched = _memory(200.0, batch_max_queries=5, candidates=candidates)
  asks = [("a memory 3", "a"), ("b memory 5", "b"), ("a memory 7", None), ("b memory 1", "b"),
          ("a memory 1", ["a", "b"])]
  before = batched.stats
  got = _together([lambda q=q, s=s: batched.search(q, 3, scope=s) for q, s in asks])
  for (q, s), slate in zip(asks, got):
    _same_slate(slate, plain.search(q, 3, scope=s))
  stats = batched.stats
  assert stats["batch_windows"] - before["batch_windows"] == 1
  assert stats["batch_searches"] - before["batch_searches"] == 1


@pytest.mark.slow
def test_a_bad_search_fails_alone_with_the_unbatched_error():
  plain, batched = _memory(0.0), _memory(50.0)
  asks = [("a memory 2", "a", 3), ("BOOM", "a", 3), ("b memory 4", "nowhere", 2),
          ("b memory 1", "b", 3)]
  got = _together([lambda q=q, s=s, k=k: batched.search(q, k, scope=s) for q, s, k in asks])
  for (q, s, k), out in zip(asks, got):
    try:
      want = plain.search(q, k, scope=s)
    except ValueError as e:
      assert type(out) is type(e) and str(out) == str(e)
      continue
    _same_slate(out, want)


@pytest.mark.slow
def test_a_search_sees_every_add_that_returned_before_it():
  mem = _memory(20.0)

  def write_then_find(j):
    mem.add([f"new memory {j}"], ids=[f"n{j}"], scope=f"s{j}")
    return mem.search(f"new memory {j}", 1, scope=f"s{j}").ids

  got = _together([lambda j=j: write_then_find(j) for j in range(4)]
                  + [lambda: mem.search("a memory 0", 2, scope="a").ids])
  assert got[:4] == [(f"n{j}",) for j in range(4)] and got[4][0] == "a0"
  assert len(mem) == 28


@pytest.mark.slow
def test_searches_adds_and_deletes_from_many_threads_stay_consistent():
  mem = _memory(5.0)
  errors = []

  def worker(j):
    try:
      for i in range(15):
        mid = f"w{j}-{i}"
        mem.add([f"worker {j} memory {i}"], ids=[mid], scope=f"w{j}")
        assert mem.search(f"worker {j} memory {i}", 1, scope=f"w{j}").ids == (mid,)
        if i % 3 == 0:
          mem.delete([mid])
          found = mem.search(f"worker {j} memory {i}", 1, scope=f"w{j}").ids if i else ()
          assert mid not in found
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  _together([lambda j=j: worker(j) for j in range(16)])
  assert not errors, errors[:3]
  assert len(mem) == 24 + 16 * 10 and mem.stats["batch_windows"] < 16 * 15 * 2


@pytest.mark.slow
def test_concurrent_frozen_recalls_equal_unbatched_ones():
  plain, batched = _memory(0.0), _memory(30.0)

  def critic(key, view):
    del key
    return np.where([i.endswith("3") for i in view.ids], 1.0, -1.0).astype(np.float32)

  asks = [(f"a memory {i}", "a") for i in range(4)] + [(f"b memory {i}", "b") for i in range(4)]
  got = _together([lambda q=q, s=s: batched.recall(q, critic, 3, scope=s, learn=False)
                   for q, s in asks])
  for (q, s), r in zip(asks, got):
    want = plain.recall(q, critic, 3, scope=s, learn=False)
    assert r.ids == want.ids and [x.ids for x in r.rounds] == [x.ids for x in want.rounds]
  assert batched.stats["batch_windows"] < len(asks)


@pytest.mark.slow
def test_an_opened_memory_takes_the_callers_batch_window(tmp_path):
  with Memory.open(tmp_path / "m", MemoryConfig(encoder=None, config=config())) as mem:
    mem.add(["one"], embeddings=np.ones((1, D)))
  with Memory.open(tmp_path / "m", batch_window_ms=4.0, batch_max_queries=8) as mem:
    assert mem.config.batch_window_ms == 4.0 and mem.config.batch_max_queries == 8
    assert mem.search(query_embedding=np.ones(D), k=1).ids == ("m0",)
    assert mem.stats["batch_windows"] == 1
