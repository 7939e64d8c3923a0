"""One EAR training episode with a real LLM critic, beside simulated critics on the same episode.

The training stream of the 80/20 split (`--seed`) runs once through the host-side episode loop
(`agent.memory.episode.run_critic_episode`) with the LLM critic, and again with each simulated
critic of `--simulated=P:R` on the same keys, split and stream: only the critic differs (Appendix
B.4). Reports each run's adapter-only Recall@5 / Hitrate@5 on the test split beside the frozen
retriever's, and the LLM's call statistics (failed replies apply no update). Without `--base_url`
the local llama.cpp server is started; replies are cached (`--llm_cache_dir`).

  python -m experiments.llm_episode --benchmark=locomo --limit=2 --max_train_queries=100 \\
      --simulated=0.88:0.86 --simulated=0.3:0.4
  OPENAI_API_KEY=... python -m experiments.llm_episode --base_url=https://api.openai.com/v1 \\
      --model=gpt-4o-mini --benchmark=jsonl --jsonl=my_bank.jsonl --out=runs/llm_episode.json
"""
import time

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

from ear_jax.agent.memory import episode as episode_lib
from ear_jax.agent.llm.critic import DEFAULT_PROMPT, PROMPTS, LLMCritic, LLMCriticConfig
from ear_jax.core import critic as critic_lib
from ear_jax.core import inference
from ear_jax.core import learner as learner_lib
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.data import corpora as datasets
from experiments import cli
from experiments import data_flags
from experiments import llm_flags

_DATA = data_flags.define(["locomo", "longmemeval", "jsonl"],
                          "Which benchmark (it must have texts for the LLM to read).")
_LLM = llm_flags.define(max_tokens=96)
_SEED = flags.DEFINE_integer("seed", 0, "Split and learner seed.")
_MAX_TRAIN = flags.DEFINE_integer("max_train_queries", None,
                                  "Use only the first N queries of the training stream (LLM calls "
                                  "cost time or money: T per query).")
_ROUNDS = flags.DEFINE_integer("num_rounds", 4, "Explorer rounds T per training query.")
_BATCH = flags.DEFINE_integer("batch_size", 4, "Training queries per optimizer step.")
_LR = flags.DEFINE_float("learning_rate", 1e-3, "Adapter learning rate.")
_PROMPT = flags.DEFINE_enum("prompt", DEFAULT_PROMPT, list(PROMPTS), "LLM critic prompt.")
_CONSTRAINED = flags.DEFINE_bool("constrained", True, "Send the reply's JSON schema as "
                                 "response_format (constrained decoding).")
_USE_LLM = flags.DEFINE_bool("llm", True, "Run the LLM critic (--nollm: only the simulated ones).")
_SIMULATED = flags.DEFINE_multi_string("simulated", [], "P:R of a simulated critic to run on the "
                                       "same episode (repeatable), e.g. 0.88:0.86.")
_OUT = flags.DEFINE_string("out", None, "JSON output path (default runs/llm_episode_<bench>.json).")

_evaluate = jax.jit(inference.evaluate, static_argnames=("config",))


def _simulated_critics():
  critics = []
  for spec in _SIMULATED.value:
    try:
      p, r = (float(x) for x in spec.split(":"))
      critics.append((f"simulated P={p:g} R={r:g}", critic_lib.make_simulated_critic(p, r)))
    except ValueError as e:
      raise app.UsageError(f"--simulated={spec!r}: expected P:R with both in (0, 1] ({e})")
  return critics


def _train(name, critic, k_episode, train, config, hparams):
  def progress(done, total):
    if done % (10 * config.batch_size) == 0 or done == total:
      logging.info("%s: trained on %d/%d queries; %s", name, done, total,
                   getattr(critic, "stats", ""))

  t = time.perf_counter()
  state, stats = episode_lib.run_critic_episode(
      k_episode, train.stream, train.query_texts, train.candidate_texts, critic, config, hparams,
      progress=progress)
  return state, stats, time.perf_counter() - t


def _scores(state, k_eval, test, config, hparams) -> dict:
  after = _evaluate(k_eval, state.params, test.stream, config, hparams)
  return {"test_recall@5_adapter": float(after.recall_adapter) * 100,
          "test_hitrate@5_adapter": float(after.hitrate_adapter) * 100,
          "params_finite": bool(all(np.all(np.isfinite(np.asarray(x)))
                                    for x in jax.tree_util.tree_leaves(state.params)))}


def main(argv):
  del argv
  t0 = time.perf_counter()
  data_flags.benchmark_name(_DATA)  # UsageError: a missing --jsonl or benchmark file
  simulated = _simulated_critics()
  bench = data_flags.load_benchmark(_DATA, progress=False)
  train_idx, test_idx = datasets.split_indices(bench.num_queries, _SEED.value)
  if _MAX_TRAIN.value is not None:
    train_idx = train_idx[:_MAX_TRAIN.value]
  if len(train_idx) == 0 or len(test_idx) == 0:
    raise app.UsageError(f"{bench.num_queries} queries: too few for a train/test split")
  train, test = bench.take(train_idx), bench.take(test_idx)
  config = EARConfig(dim=bench.stream.dim, num_candidates=_DATA.k.value, num_rounds=_ROUNDS.value,
                     batch_size=_BATCH.value, slate_size=min(5, _DATA.k.value))
  hparams = default_hparams(learning_rate=_LR.value)
  k_episode, k_eval = jax.random.split(jax.random.PRNGKey(_SEED.value))
  frozen = learner_lib.init_learner(jax.random.PRNGKey(0), config).params
  before = _evaluate(k_eval, frozen, test.stream, config, hparams)
  result = {
      "benchmark": bench.name, "seed": _SEED.value, "num_train_queries": int(len(train_idx)),
      "num_test_queries": int(len(test_idx)), "num_rounds": config.num_rounds,
      "batch_size": config.batch_size, "learning_rate": _LR.value,
      "test_recall@5_retriever": float(before.recall_adapter) * 100,
      "test_hitrate@5_retriever": float(before.hitrate_adapter) * 100, "runs": {},
  }
  if _USE_LLM.value:
    with llm_flags.endpoint(_LLM) as (base_url, model, info):
      critic = LLMCritic(LLMCriticConfig(**llm_flags.client_kwargs(_LLM, base_url, model),
                                         prompt=_PROMPT.value, constrained=_CONSTRAINED.value))
      state, stats, seconds = _train("LLM critic", critic, k_episode, train, config, hparams)
    calls = critic.client.stats["calls"] - critic.client.stats["cache_hits"]
    result.update(model=model, base_url=base_url, endpoint=info, prompt=_PROMPT.value,
                  constrained=_CONSTRAINED.value, critic=dict(critic.stats),
                  client=dict(critic.client.stats), episode=stats,
                  train_seconds=round(seconds, 2),
                  seconds_per_fresh_call=critic.client.stats["seconds"] / calls if calls else None)
    scores = _scores(state, k_eval, test, config, hparams)
    result["runs"][f"LLM critic ({model})"] = dict(scores, episode=stats)
    # Backward-compatible keys of the LLM run.
    result["test_recall@5_ear_adapter"] = scores["test_recall@5_adapter"]
    result["test_hitrate@5_ear_adapter"] = scores["test_hitrate@5_adapter"]
    result["params_finite"] = scores["params_finite"]
  for label, critic in simulated:
    state, stats, seconds = _train(label, critic, k_episode, train, config, hparams)
    result["runs"][label] = dict(_scores(state, k_eval, test, config, hparams), episode=stats,
                                 train_seconds=round(seconds, 2))
  result["wall_seconds"] = round(time.perf_counter() - t0, 2)
  out = cli.write_json(_OUT.value or f"runs/llm_episode_{bench.name}.json", result)
  lines = [f"test Recall@5 (adapter-only, {len(test_idx)} test queries, {len(train_idx)} training "
           f"queries, seed {_SEED.value}): frozen retriever {result['test_recall@5_retriever']:.2f}"]
  for label, run in result["runs"].items():
    lines.append(f"  EAR with {label}: {run['test_recall@5_adapter']:.2f} "
                 f"(Hit@5 {run['test_hitrate@5_adapter']:.2f}; {run['episode']})")
  if _USE_LLM.value:
    lines.append(f"  LLM critic {result['critic']}; client {result['client']}")
  print("\n".join(lines) + f"\nwrote {out}")


if __name__ == "__main__":
  cli.run(main)  # a usage error: its message, not absl's help dump
