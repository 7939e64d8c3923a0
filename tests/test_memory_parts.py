"""Tests of the parts of `Memory`: ear_jax/agent/{bank,sessions,driver}.py, and that `Memory`'s
training is the core's (one query and one experience per question, as `run_episode`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory.driver import Driver
from ear_jax.agent.memory import Memory
from ear_jax.agent.memory.sessions import Sessions, TrainItem
from ear_jax.core import episode as episode_lib
from ear_jax.core import learner as learner_lib
from ear_jax.core import retrieval as retrieval_lib
from ear_jax.core.config import default_hparams
from ear_jax.core.critic import OracleCritic
from ear_jax.core.stream import Stream, make_stream
from tests.test_memory import _config

jit_train_batch_on_feedback = jax.jit(learner_lib.train_batch_on_feedback,
                                      static_argnames=("config",))

_D = 16


def _unit(x):
  x = np.asarray(x, np.float32)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)




# ------------------------------------------------------------------------------------------------
# bank


def test_capacity_is_a_power_of_two_then_grows_in_quarter_steps():
  assert [bank_lib.capacity_for(n) for n in (1, 33, 4096, 4097, 5121, 8192, 10_000, 1_000_000)] == [
      32, 64, 4096, 5120, 6144, 8192, 10240, 1_048_576]
  for n in range(1, 200_000, 997):  # always holds n, wastes at most a quarter beyond 4,096
    c = bank_lib.capacity_for(n)
    assert n <= c and (c <= 4096 or c <= 1.25 * n)


def test_append_writes_in_place_and_keeps_earlier_rows():
  rng = np.random.default_rng(3)
  bank = bank_lib.Bank(_D, 64)
  first = _unit(rng.normal(size=(10, _D)))
  bank.append([f"a{i}" for i in range(10)], ["t"] * 10, np.zeros(10, np.int8), first)
  old = bank.emb
  bank.append(["b"], ["t"], np.zeros(1, np.int8), _unit(rng.normal(size=(1, _D))))
  assert old.is_deleted()  # donated: no copy of the bank per add
  np.testing.assert_array_equal(bank.embeddings(0, 10), first)


@pytest.mark.slow
def test_bank_capacity_doubles_and_candidate_search_compiles_once_per_capacity():
  rng = np.random.default_rng(0)
  bank = bank_lib.Bank(_D, 8)
  before = bank_lib._search._cache_size()
  capacities = set()
  for i in range(130):
    bank.append([f"t{i}"], [f"text {i}"], np.zeros(1, np.int8), _unit(rng.normal(size=(1, _D))))
    bank.search(_unit(rng.normal(size=(1, _D))), 8, multistore=False)
    capacities.add(bank.capacity)
  assert bank.capacity == 256 and len(bank) == 130
  assert capacities == {32, 64, 128, 256}
  assert bank_lib._search._cache_size() - before <= len(capacities)
  assert int(np.asarray(bank.valid).sum()) == 130


def test_bank_search_is_top_k_search_over_dialogue_memories_only_without_multistore():
  rng = np.random.default_rng(1)
  emb = _unit(rng.normal(size=(20, _D)))
  codes = np.asarray([0, 1] * 10, np.int8)
  bank = bank_lib.Bank(_D)
  bank.append([f"m{i}" for i in range(20)], [f"t{i}" for i in range(20)], codes, emb)
  q = _unit(rng.normal(size=(3, _D)))
  rows, mask, cands = bank.search(q, 8, multistore=False)
  idx, _, ref_mask = retrieval_lib.top_k_search(q, emb, codes == 0, 8)
  np.testing.assert_array_equal(rows, np.asarray(idx))
  np.testing.assert_array_equal(mask, np.asarray(ref_mask))
  np.testing.assert_allclose(cands, emb[rows], rtol=1e-6)
  assert np.all(codes[rows] == 0)
  rows, _, _ = bank.search(q, 8, multistore=True)
  assert np.all((codes[rows] == 0).sum(1) == 4)


# ------------------------------------------------------------------------------------------------
# sessions


def _session(sessions, rng):
  k = sessions.config.num_candidates
  return sessions.new("q", _unit(rng.normal(size=_D)), np.arange(k, dtype=np.int32),
                      _unit(rng.normal(size=(k, _D))), np.ones(k, bool))


def test_a_session_closes_after_t_explorer_rounds_or_one_adapter_only_round():
  rng = np.random.default_rng(2)
  ss = Sessions(_config(num_rounds=3), max_sessions=10)  # no compilation here: any config
  sid = _session(ss, rng)
  items = []
  for t in range(3):
    ss.open_round(sid, np.asarray([t, t + 3], np.int32), explore=True)
    items.append(ss.record(sid, np.asarray([1.0, -1.0], np.float32)))
  assert items[:2] == [None, None] and isinstance(items[2], TrainItem)
  item = items[2]
  assert item.slates.shape == (3, 8) and item.slate_mask.sum() == 6
  np.testing.assert_array_equal(item.slates[:, :2], [[0, 3], [1, 4], [2, 5]])
  assert ss.by_id[sid].closed and ss.by_id[sid].counts.sum() == 6
  sid2 = _session(ss, rng)
  ss.open_round(sid2, np.asarray([0], np.int32), explore=False)
  item2 = ss.record(sid2, np.asarray([-1.0], np.float32))
  assert item2 is not None and item2.slate_mask.sum() == 1


def test_eviction_queues_least_recently_used_sessions_with_feedback_and_drops_the_others():
  rng = np.random.default_rng(3)
  ss = Sessions(_config(), max_sessions=2)
  a, b, c = (_session(ss, rng) for _ in range(3))
  ss.open_round(a, np.asarray([0], np.int32), explore=True)
  ss.record(a, np.asarray([1.0], np.float32))  # a: one round of feedback
  rid_b = ss.open_round(b, np.asarray([1], np.int32), explore=True)  # b: open, no feedback
  ss.open_round(c, np.asarray([1], np.int32), explore=True)
  items = ss.evict()  # a is the least recently used: queued with its round, not dropped
  assert len(items) == 1 and items[0].slate_mask.sum() == 1 and set(ss.by_id) == {b, c}
  d = _session(ss, rng)
  assert ss.evict() == [] and set(ss.by_id) == {c, d}  # b had no feedback: dropped
  with pytest.raises(ValueError, match="no longer open"):
    ss.open_session(rid_b)


def test_eviction_drops_closed_sessions_before_open_ones_each_least_recently_used_first():
  rng = np.random.default_rng(4)
  ss = Sessions(_config(), max_sessions=5)  # one round per session: feedback closes it
  sids = [_session(ss, rng) for _ in range(5)]
  for sid in (sids[2], sids[4]):  # closed: 2 and 4; open: 0, 1, 3 (0 least recently used)
    ss.open_round(sid, np.asarray([0], np.int32), explore=False)
    assert ss.record(sid, np.asarray([1.0], np.float32)) is not None
  extra = [_session(ss, rng) for _ in range(3)]  # 3 over the limit
  assert ss.evict() == [] and set(ss.by_id) == {sids[1], sids[3]} | set(extra)


# ------------------------------------------------------------------------------------------------
# driver


def _item(rng, cfg, rounds=2):
  k, T = cfg.num_candidates, cfg.num_rounds
  slates = np.full((T, k), -1, np.int32)
  mask = np.zeros((T, k), bool)
  for t in range(rounds):
    slates[t, :cfg.slate_size] = rng.permutation(k)[:cfg.slate_size]
    mask[t, :cfg.slate_size] = True
  labels = np.where(mask, rng.choice([-1.0, 1.0], size=(T, k)), -1.0).astype(np.float32)
  return TrainItem(_unit(rng.normal(size=_D)), _unit(rng.normal(size=(k, _D))), np.ones(k, bool),
                   slates, mask, labels, np.arange(k, dtype=np.int32))


def test_driver_takes_one_learner_step_per_batch_size_items_and_flush_pads_the_rest():
  cfg = _config(batch_size=2)
  rng = np.random.default_rng(4)
  d = Driver(cfg, default_hparams(), seed=0)
  assert d.push([_item(rng, cfg) for _ in range(5)]) == 2
  assert int(d.state.step) == 2 and int(d.state.queries_seen) == 4 and len(d.ready) == 1
  assert d.flush() == 1 and int(d.state.queries_seen) == 5 and int(d.state.buffer.num_pushed) == 5
  assert d.flush() == 0


def test_driver_step_is_train_batch_on_feedback_with_the_documented_keys():
  cfg = _config(batch_size=2)
  rng = np.random.default_rng(5)
  items = [_item(rng, cfg) for _ in range(4)]
  d = Driver(cfg, default_hparams(), seed=7)
  d.push(items)
  k_init, k_train, _ = jax.random.split(jax.random.PRNGKey(7), 3)
  state = learner_lib.init_learner(k_init, cfg)
  for j in range(2):
    b = TrainItem(*(np.stack(x) for x in zip(*items[2 * j:2 * j + 2])))
    batch = Stream(queries=b.query, candidates=b.candidates, mask=b.mask,
                   gold=np.zeros(b.mask.shape, bool), num_gold=np.zeros(2, np.int32))
    state, _ = jit_train_batch_on_feedback(
        state, jax.random.split(jax.random.fold_in(k_train, j), 2), batch, b.slates, b.slate_mask,
        b.labels, jnp.ones(2, bool), cfg, default_hparams())
  for x, y in zip(jax.tree_util.tree_leaves(d.state), jax.tree_util.tree_leaves(state)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Memory trains what the core trains


@pytest.mark.slow
def test_memory_trains_one_query_per_question_and_pushes_the_experience_run_episode_pushes():
  """Two questions, T=2 Explorer rounds each through the Memory API, citing exactly the gold:
  ONE learner step on TWO training queries (not 2 T), and the buffer rows (query, candidates,
  mask, observed, ybar), the slates and the parameters equal `run_episode`'s with the oracle
  critic on the same candidates."""
  cfg = _config()
  hp = default_hparams()
  rng = np.random.default_rng(6)
  emb = _unit(rng.normal(size=(24, _D)))
  q = _unit(rng.normal(size=(2, _D)))
  m = Memory(None, config=cfg, seed=0)
  m.add([f"t{i}" for i in range(24)], embeddings=emb)
  idx, _, mask = retrieval_lib.top_k_search(q, m.embeddings(), np.ones(24, bool), 8)
  idx = np.asarray(idx)
  gold = np.zeros((2, 8), bool)
  gold[:, [2, 5]] = True  # two gold memories per question, below the frozen top-s
  gold_ids = [{f"m{r}" for r in idx[j][gold[j]]} for j in range(2)]
  rs = m.retrieve_batch(["a", "b"], k=3, explore=True, query_embeddings=q)
  for t in range(cfg.num_rounds):
    if t:
      rs = m.retrieve_batch(continue_from=rs, k=3, explore=True)
    assert int(m.state.step) == 0  # no round is trained on its own
    m.feedback_batch(rs, [[i for i in r.ids if i in gold_ids[j]] for j, r in enumerate(rs)])
  assert int(m.state.step) == 1 and int(m.state.queries_seen) == 2
  assert int(m.state.buffer.num_pushed) == 2

  stream = make_stream(q, m.embeddings()[idx], np.asarray(mask), gold)
  ref, records = episode_lib.run_episode(jax.random.PRNGKey(0), stream, cfg, hp, OracleCritic())
  for f in ("queries", "candidates", "mask", "observed", "ybar"):
    np.testing.assert_allclose(np.asarray(getattr(m.state.buffer, f))[:2],
                               np.asarray(getattr(ref.buffer, f))[:2], rtol=1e-6, err_msg=f)
  assert np.asarray(m.state.buffer.observed)[:2].sum() > 3  # the rounds explored
  mem_slates = np.stack([m._sessions.by_id[r.session_id].slates[:, :3] for r in rs])
  np.testing.assert_array_equal(mem_slates, np.asarray(records.slates))
  for x, y in zip(jax.tree_util.tree_leaves(m.params), jax.tree_util.tree_leaves(ref.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
  assert not np.allclose(np.asarray(m.params.w_q), 0.0)
