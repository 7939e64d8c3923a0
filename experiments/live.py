"""The live benchmark: a benchmark's questions streamed through the agent's `Memory`, beside the
jitted runner on the same seeds (`ear_jax.experiment.live`).

  python -m experiments.live --benchmark=locomo --method=ear_tuned --seeds=10
  python -m experiments.live --benchmark=locomo --method=ear --seeds=10 --out=runs/live_ear
  python -m experiments.live --benchmark=synthetic --method=ear --seeds=2 --synthetic_queries=200

Writes results.json (per-seed metrics, paired differences live - runner, identical slates, costs
per question) and table.md (also printed) into --out.
"""
import os
import pathlib

from absl import app
from absl import flags
from absl import logging

from ear_jax.core import config as config_lib
from ear_jax.core import critic as critic_lib
from experiments import cli
from experiments import config_flags
from experiments import data_flags

# Methods a live `Memory` can run (its training slates are the Explorer rounds it plays).
LIVE_METHODS = ("ear", "ear_tuned", "ear_no_replay")

_DATA = data_flags.define(["locomo", "longmemeval", "synthetic"])
_METHOD = flags.DEFINE_enum("method", "ear_tuned", list(LIVE_METHODS), "Method (a preset with its "
                            "own hyperparameters) run by both the runner and Memory.")
_SEEDS = flags.DEFINE_integer("seeds", 10, "Number of seeds (0..seeds-1).", lower_bound=1)
_OUT = flags.DEFINE_string("out", None,
                           "Output directory (default runs/live_<benchmark>_<method>).")
_TIME_SCAN = flags.DEFINE_bool("time_scan", True, "Run the runner a second time, compiled, for "
                               "the scan's cost per question (else its first run, compile "
                               "included).")
_SYN_QUERIES = flags.DEFINE_integer("synthetic_queries", 500, "Synthetic benchmark: queries.",
                                    lower_bound=10)
_SYN_DIM = flags.DEFINE_integer("synthetic_dim", 32, "Synthetic benchmark: dimension d.",
                                lower_bound=2)
_PROGRESS = flags.DEFINE_bool("progress", True, "Progress bar while encoding.")
_CRITIC = config_flags.define_critic_flags()
_CONFIG_FLAGS = config_flags.define_config_flags()
_HPARAM_FLAGS = config_flags.define_hparam_flags()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  bench = _DATA.benchmark.value
  data_flags.benchmark_name(_DATA)  # UsageError: the benchmark file is missing
  hp_over, cfg_over = config_flags.overrides(_HPARAM_FLAGS), config_flags.overrides(_CONFIG_FLAGS)
  try:
    critic = critic_lib.make_simulated_critic(**config_flags.overrides(_CRITIC))
    probe = config_lib.Method.named(_METHOD.value, dim=8, hparams=hp_over, **cfg_over)
    from ear_jax.agent.memory import Memory, MemoryConfig  # pylint: disable=g-import-not-at-top
    # refuses a config Memory cannot honour, naming the field
    Memory(MemoryConfig(encoder=None, config=probe.config, hparams=probe.hparams)).close()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  from ear_jax.experiment import live  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import runner  # pylint: disable=g-import-not-at-top
  out = _OUT.value or os.path.join("runs", f"live_{bench}_{_METHOD.value}")
  data = live.load_live_data(
      bench, data_dir=_DATA.data_dir.value, encoder=_DATA.encoder.value,
      cache_dir=_DATA.cache_dir.value, limit=_DATA.limit.value, k=_DATA.k.value,
      progress=_PROGRESS.value, synthetic_queries=_SYN_QUERIES.value,
      synthetic_dim=_SYN_DIM.value)
  s = data.bench.stream
  method = runner.build_method(_METHOD.value, dim=s.dim, num_candidates=s.num_candidates,
                               hparams=hp_over, **cfg_over)
  cmp, _ = live.run(data, method, range(_SEEDS.value), critic, time_scan=_TIME_SCAN.value,
                    name=f"live_{_METHOD.value}")
  cmp["command"] = cli.command("experiments.live")
  cmp["critic"] = {"precision": float(critic.precision), "recall": float(critic.recall)}
  md = live.table_md(cmp, title=f"Live `Memory` vs the jitted runner: {_METHOD.value} on {bench}, "
                     f"{_SEEDS.value} seeds") + f"\n\nCommand: `{cmp['command']}`\n"
  cli.write_json(os.path.join(out, "results.json"), cmp)
  pathlib.Path(out, "table.md").write_text(md)
  from ear_jax.experiment import plots  # pylint: disable=g-import-not-at-top
  names = live.MODE_NAMES
  plot = os.path.join(out, f"live_vs_runner_{bench}_{_METHOD.value}.png")
  plots.per_seed_scatter(
      plot, {names[m]: (cmp["modes"][m]["recall"]["runner"], cmp["modes"][m]["recall"]["live"])
             for m in live.MODES},
      xlabel="jitted runner Recall@5 (%)", ylabel="live Memory Recall@5 (%)",
      title=f"{_METHOD.value} on {bench}: one point per seed")
  print(md)
  print(f"wrote {out}/results.json, {out}/table.md, {plot}")
  return 0


if __name__ == "__main__":
  cli.run(main)
