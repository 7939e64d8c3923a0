"""Dataset report: statistics and the frozen first stage's Recall@5 / Hitrate@5 / Recall@K
ceiling over all evaluable queries, overall and per category.

  EAR_DATA_DIR=../shared/data python -m experiments.prepare --benchmark=locomo
  python -m experiments.prepare --benchmark=locomo --candidates=bm25     # or hybrid
  python -m experiments.prepare --benchmark=jsonl --jsonl=my_bank.jsonl
"""
import os
import time

from absl import flags

from ear_jax.data import first_stage
from experiments import cli
from experiments import data_flags
from experiments import first_stage_flags

_DATA = data_flags.define(["locomo", "longmemeval", "jsonl", "synthetic"])
_FIRST_STAGE = first_stage_flags.define()
_MULTISTORE = flags.DEFINE_bool("multistore", False, "Top-K/2 dialogue turns + top-K/2 observations.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed (synthetic benchmark only).")
_OUT = flags.DEFINE_string("out", None, "JSON output path (default runs/prepare_<benchmark>.json).")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show the encoding progress bar.")


def _table(report):
  rows = [("overall", report["overall"])] + list(report["per_category"].items())
  rows += [(f"store:{k}", v) for k, v in report.get("per_store", {}).items()]
  lines = [f"{'':28s} {'n':>5s} {'R@5':>6s} {'Hit@5':>6s} {'R@K':>6s} {'R@5max':>6s} {'Hit@K':>6s}"]
  for name, r in rows:
    if not r["n"]:
      continue
    lines.append(f"{name:28s} {r['n']:5d} {r['recall@5']:6.2f} {r['hitrate@5']:6.2f} "
                 f"{r['recall@K_ceiling']:6.2f} {r['recall@5_ceiling']:6.2f} {r['hitrate@K_ceiling']:6.2f}")
  return "\n".join(lines)


def main(argv):
  del argv
  data_flags.benchmark_name(_DATA)  # UsageError: a missing --jsonl or benchmark file
  fs = first_stage_flags.options(_FIRST_STAGE)
  t0 = time.perf_counter()
  bench = data_flags.load_benchmark(
      _DATA, multistore=_MULTISTORE.value, seed=_SEED.value, progress=_PROGRESS.value,
      candidates=fs["candidates"], side_features=bool(fs["side_features"]),
      first_stage_options=first_stage.FirstStageOptions.with_defaults(fs["fusion"],
                                                                      fs["lexical_weight"]))
  stats = dict(bench.stats)
  stats["wall_seconds"] = round(time.perf_counter() - t0, 2)
  report = stats.pop("retriever")
  if bench.name == "locomo":
    print(f"== Table 1 (LoCoMo): conversations {stats['conversations']}, sessions {stats['sessions']}, "
          f"dialogue turns {stats['turns']:,}, queries {stats['queries']:,} "
          f"({stats['queries_evaluable']:,} evaluable)")
  elif bench.name == "longmemeval":
    print(f"== LongMemEval: questions {stats['questions']}, evaluable {stats['queries_evaluable']}, "
          f"sessions {stats['sessions']:,}, turns {stats['turns']:,}, user turns "
          f"{stats['user_turns']:,} ({stats['user_turns_distinct_texts']:,} distinct texts)")
  print(f"== {bench.name}: dataset statistics")
  for key, val in stats.items():
    if key != "encoding":
      print(f"  {key}: {val}")
  print("  encoding: " + ", ".join(f"{k}={v}" for k, v in stats["encoding"].items()))
  print(f"== frozen first stage: candidates={fs['candidates']}"
        + (f" ({stats['first_stage_options']})" if "first_stage_options" in stats else "")
        + f", encoder {stats['encoding'].get('encoder')}, K={_DATA.k.value}, "
        f"multistore={_MULTISTORE.value}, all {bench.num_queries} evaluable queries, percent")
  print(_table(report))
  suffix = ("_multistore" if _MULTISTORE.value else "") + (
      "" if fs["candidates"] == "dense" else "_" + fs["candidates"])
  out = _OUT.value or os.path.join("runs", f"prepare_{_DATA.benchmark.value}{suffix}.json")
  cli.write_json(out, {"benchmark": _DATA.benchmark.value, "flags": {
      "encoder": _DATA.encoder.value, "k": _DATA.k.value, "multistore": _MULTISTORE.value, **fs,
      "limit": _DATA.limit.value, "seed": _SEED.value}, "stats": stats, "retriever": report})
  print(f"wrote {out}")


if __name__ == "__main__":
  cli.run(main)  # a usage error: its message, not absl's help dump
