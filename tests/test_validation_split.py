"""The validation protocol: the split never touches a test query; sweeps equal single runs."""
import numpy as np
import pytest

from ear_jax.core.config import EARConfig, default_hparams, stack_hparams
from ear_jax.experiment import runner
from ear_jax.experiment import sweep
from ear_jax.experiment.suites import options
from ear_jax.experiment.suites import run_cache
from ear_jax.experiment.suites import tune
from tests.core_utils import learnable_stream


@pytest.mark.parametrize("num_queries", [10, 97, 1536])
def test_validation_split_never_includes_a_test_query(num_queries):
  seeds = list(range(6))
  train, test = runner.seed_splits(num_queries, seeds)
  fit, val = runner.validation_split(train)
  n = train.shape[1]
  assert val.shape[1] == int(round(0.2 * n)) and fit.shape[1] == n - val.shape[1]
  for i in range(len(seeds)):
    # Validation is the END of the online training stream, in stream order.
    np.testing.assert_array_equal(np.concatenate([fit[i], val[i]]), train[i])
    assert not set(val[i]) & set(test[i]), "a validation query is a test query"
    assert not set(fit[i]) & set(test[i]), "a fit query is a test query"
    assert not set(fit[i]) & set(val[i])
    assert len(set(val[i])) == val.shape[1]


def test_validation_split_rejects_bad_fractions_and_tiny_streams():
  train, _ = runner.seed_splits(20, [0])
  for frac in (0.0, 1.0, -0.1):
    with pytest.raises(ValueError, match="validation_fraction"):
      runner.validation_split(train, frac)
  with pytest.raises(ValueError, match="empty fit or validation"):
    runner.validation_split(train[:, :2], 0.2)


def test_tune_refuses_the_transfer_benchmark(tmp_path):
  r = run_cache.Runner(options.Options(benchmark="longmemeval", workdir=str(tmp_path), seeds=5))
  with pytest.raises(ValueError, match="transfer benchmark"):
    tune.tune(r)


@pytest.mark.slow
def test_sweep_of_stacked_hparams_equals_single_runs_on_the_validation_split():
  stream = learnable_stream(0, 60, d=8, k=8)
  seeds = [0, 1]
  train, _ = runner.seed_splits(60, seeds)
  fit, val = runner.validation_split(train)
  config = EARConfig(dim=8, num_candidates=8, buffer_capacity=64)
  hps = [default_hparams(learning_rate=3e-2), default_hparams(learning_rate=1e-2, baseline=0.0)]
  out = sweep.sweep_validation(stream, fit, val, config, stack_hparams(hps), seeds,
                               eval_variants={"default": {}, "exploit": {"final_slate": "exploit"}})
  assert out["recall_adapter"].shape == (2, 2)
  for h, hp in enumerate(hps):
    # The same keys as the runner: training on `fit` and testing on `val` is a single run.
    res = runner.train_and_evaluate("x", stream, fit, val, config, hp, seeds)
    np.testing.assert_allclose(out["recall_adapter"][h], 100 * res.eval["recall_adapter"],
                               atol=1e-4)
    np.testing.assert_allclose(out["explorer"]["default"]["recall"][h],
                               100 * res.eval["recall_explorer"], atol=1e-4)
  # The two settings really differ (the sweep is not one setting broadcast).
  assert not np.allclose(out["recall_adapter"][0], out["recall_adapter"][1]) or not np.allclose(
      out["explorer"]["exploit"]["recall"], out["explorer"]["default"]["recall"])
