"""One EAR training episode with a real LLM critic instead of the simulated one.

The benchmark's queries are split 80/20 (Section 4.4, `--seed`); the training stream is processed
once, in order, with `ear_jax.agent.episode.run_critic_episode` (host-side loop: T Explorer rounds
per query whose labels come from the LLM's citations through the critic protocol
`critic(key, view)`, then the one jitted learner step). At the end the adapter-only Recall@5 / Hitrate@5 on the test split is
reported beside the frozen retriever's, with the critic's call statistics (unparseable replies, HTTP
errors and timeouts apply no update and are counted).

  python -m experiments.llm_episode --benchmark=locomo --limit=1 \\
      --base_url=http://localhost:8000/v1 --model=Qwen/Qwen2.5-7B-Instruct --max_train_queries=40
  OPENAI_API_KEY=... python -m experiments.llm_episode --base_url=https://api.openai.com/v1 \\
      --model=gpt-4o-mini --benchmark=jsonl --jsonl=my_bank.jsonl --out=runs/llm_episode.json
"""
import json
import pathlib
import time

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

from ear_jax.data import candidates
from ear_jax.data import corpora as datasets
from ear_jax.core import inference
from ear_jax.core import learner as learner_lib
from ear_jax.agent import episode as episode_lib
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.agent.llm_critic import LLMCritic, LLMCriticConfig
from experiments import data_flags

_DATA = data_flags.define(["locomo", "longmemeval", "jsonl"],
                          "Which benchmark (it must have texts for the LLM to read).")
_SEED = flags.DEFINE_integer("seed", 0, "Split and learner seed.")
_MAX_TRAIN = flags.DEFINE_integer("max_train_queries", None,
                                  "Use only the first N queries of the training stream (LLM calls "
                                  "cost money: T per query).")
_ROUNDS = flags.DEFINE_integer("num_rounds", 4, "Explorer rounds T per training query.")
_BATCH = flags.DEFINE_integer("batch_size", 4, "Training queries per optimizer step.")
_LR = flags.DEFINE_float("learning_rate", 1e-3, "Adapter learning rate.")
_BASE_URL = flags.DEFINE_string("base_url", None, "OpenAI-compatible endpoint, e.g. "
                                "http://localhost:8000/v1.", required=True)
_MODEL = flags.DEFINE_string("model", None, "Model name sent to the endpoint.", required=True)
_API_KEY_ENV = flags.DEFINE_string("api_key_env", "OPENAI_API_KEY",
                                   "NAME of the environment variable holding the API key.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 60.0, "Seconds per request (connect, read, whole reply).")
_RETRIES = flags.DEFINE_integer("max_retries", 3, "Retries for HTTP 429/5xx, timeouts, connection "
                                "errors.")
_BACKOFF = flags.DEFINE_float("backoff_base_s", 1.0, "Base of the exponential retry backoff.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 512, "Reply token budget.")
_OUT = flags.DEFINE_string("out", None, "JSON output path (default runs/llm_episode_<bench>.json).")


def main(argv):
  del argv
  t0 = time.perf_counter()
  name = data_flags.benchmark_name(_DATA)
  bench = candidates.load_benchmark(name, data_dir=_DATA.data_dir.value, encoder=_DATA.encoder.value,
                                    k=_DATA.k.value, limit=_DATA.limit.value, cache_dir=_DATA.cache_dir.value,
                                    progress=False)
  train_idx, test_idx = datasets.split_indices(bench.num_queries, _SEED.value)
  if _MAX_TRAIN.value is not None:
    train_idx = train_idx[:_MAX_TRAIN.value]
  if len(train_idx) == 0 or len(test_idx) == 0:
    raise app.UsageError(f"{bench.num_queries} queries: too few for a train/test split")
  train, test = bench.take(train_idx), bench.take(test_idx)
  config = EARConfig(dim=bench.stream.dim, num_candidates=_DATA.k.value, num_rounds=_ROUNDS.value,
                     batch_size=_BATCH.value, slate_size=min(5, _DATA.k.value))
  hparams = default_hparams(learning_rate=_LR.value)
  critic = LLMCritic(LLMCriticConfig(
      base_url=_BASE_URL.value, model=_MODEL.value, api_key_env=_API_KEY_ENV.value,
      timeout_s=_TIMEOUT.value, max_retries=_RETRIES.value, backoff_base_s=_BACKOFF.value,
      temperature=_TEMPERATURE.value, max_tokens=_MAX_TOKENS.value))
  key = jax.random.PRNGKey(_SEED.value)
  k_episode, k_eval = jax.random.split(key)

  def progress(done, total):
    if done % (10 * config.batch_size) == 0 or done == total:
      logging.info("trained on %d/%d queries; critic %s", done, total, critic.stats)

  t_train = time.perf_counter()
  state, stats = episode_lib.run_critic_episode(
      k_episode, train.stream, train.query_texts, train.candidate_texts, critic, config, hparams,
      progress=progress)
  t_train = time.perf_counter() - t_train
  frozen = learner_lib.init_learner(jax.random.PRNGKey(0), config).params
  before = inference.evaluate_jit(k_eval, frozen, test.stream, config, hparams)
  after = inference.evaluate_jit(k_eval, state.params, test.stream, config, hparams)
  result = {
      "benchmark": bench.name, "seed": _SEED.value, "model": _MODEL.value,
      "base_url": _BASE_URL.value, "num_train_queries": int(len(train_idx)),
      "num_test_queries": int(len(test_idx)), "num_rounds": config.num_rounds,
      "batch_size": config.batch_size, "learning_rate": _LR.value,
      "test_recall@5_retriever": float(before.recall_adapter) * 100,
      "test_hitrate@5_retriever": float(before.hitrate_adapter) * 100,
      "test_recall@5_ear_adapter": float(after.recall_adapter) * 100,
      "test_hitrate@5_ear_adapter": float(after.hitrate_adapter) * 100,
      "episode": stats, "critic": dict(critic.stats),
      "params_finite": bool(all(np.all(np.isfinite(np.asarray(x)))
                                for x in jax.tree_util.tree_leaves(state.params))),
      "train_seconds": round(t_train, 2), "wall_seconds": round(time.perf_counter() - t0, 2),
  }
  out = pathlib.Path(_OUT.value or f"runs/llm_episode_{bench.name}.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  print(f"test Recall@5: retriever {result['test_recall@5_retriever']:.2f} -> EAR (LLM critic) "
        f"{result['test_recall@5_ear_adapter']:.2f}; critic {critic.stats}; wrote {out}")


if __name__ == "__main__":
  app.run(main)
