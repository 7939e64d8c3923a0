"""Tests for ear_jax/data/synthetic.py: seeded, mediocre frozen cosine, learnable by a linear adapter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.data import candidates
from ear_jax.data import corpora as datasets
from ear_jax.data import synthetic


@pytest.fixture(scope="module")
def bench():
  return candidates.load_benchmark("synthetic", seed=0)


def test_same_seed_same_benchmark_and_seeds_differ(bench):
  again = candidates.load_benchmark("synthetic", seed=0)
  np.testing.assert_array_equal(bench.stream.queries, again.stream.queries)
  np.testing.assert_array_equal(bench.stream.gold, again.stream.gold)
  other = candidates.load_benchmark("synthetic", seed=1)
  assert not np.allclose(bench.stream.queries, other.stream.queries)


def test_shapes_padding_and_gold(bench):
  s = bench.stream
  assert s.queries.shape == (500, 32) and s.candidates.shape == (500, 20, 32)
  assert (~s.mask).any()  # bank 0 is smaller than K: padded
  assert s.gold.any(1).mean() > 0.9 and (s.num_gold >= 1).all() and (s.num_gold <= 2).all()
  np.testing.assert_allclose(np.linalg.norm(s.queries, axis=1), 1.0, atol=1e-5)


def test_frozen_cosine_is_mediocre_but_the_ceiling_is_high(bench):
  r = bench.stats["retriever"]["overall"]
  assert 30 <= r["recall@5"] <= 60
  assert r["recall@K_ceiling"] >= 90


def _recall5(w, s, idx):
  q = s.queries[idx] @ (np.eye(s.dim) + w)
  q /= np.linalg.norm(q, axis=1, keepdims=True)
  z = np.where(s.mask[idx], np.einsum("nd,nkd->nk", q, s.candidates[idx]), -np.inf)
  top = np.argsort(-z, axis=1, kind="stable")[:, :5]
  return 100 * np.mean(np.take_along_axis(s.gold[idx], top, 1).sum(1) == s.num_gold[idx])


def test_a_linear_adapter_learns_it_online_from_a_few_hundred_queries(bench):
  s = bench.stream
  train, test = datasets.split_indices(s.num_queries, seed=0)

  def loss(w, q, c, m, g):
    qq = q @ (jnp.eye(q.shape[-1]) + w)
    qq = qq / jnp.linalg.norm(qq, axis=-1, keepdims=True)
    z = jnp.where(m, jnp.einsum("nd,nkd->nk", qq, c) / 0.1, -1e9)
    lp = jax.nn.log_softmax(z)
    return -(jnp.where(g, lp, 0).sum(-1) / jnp.maximum(g.sum(-1), 1)).mean()

  grad = jax.jit(jax.grad(loss))
  w = jnp.zeros((s.dim, s.dim))
  for i in range(0, len(train), 4):  # one online pass, batches of 4
    b = train[i:i + 4]
    w = w - 0.05 * grad(w, s.queries[b], s.candidates[b], s.mask[b], s.gold[b])
  before, after = _recall5(np.zeros((s.dim, s.dim)), s, test), _recall5(np.asarray(w), s, test)
  assert after >= before + 20, (before, after)


def test_hidden_map_is_a_rotation():
  a = synthetic.hidden_map(16, 0.8, seed=3)
  np.testing.assert_allclose(a @ a.T, np.eye(16), atol=1e-4)
  assert not np.allclose(a, np.eye(16), atol=0.1)


def test_multistore_synthetic_has_observations_with_derived_gold():
  b = candidates.load_benchmark("synthetic", seed=0, multistore=True, limit=100)
  assert ((b.candidate_store == 1).sum(1) <= 10).all() and (b.candidate_store == 1).any()
  assert (b.num_gold_store[:, 1] > 0).any()
