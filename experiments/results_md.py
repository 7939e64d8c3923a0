"""Assembles RESULTS.md from the workdirs of `experiments.run` (`ear_jax.experiment.results_md`).

  python -m experiments.results_md runs/locomo_main [runs/longmemeval_all ...]
  python -m experiments.results_md --beyond runs/locomo_tune runs/locomo_beyond ...

Rewrites only the block between the `<!-- generated:begin -->` / `<!-- generated:end -->` markers
(with `--beyond`: the `<!-- beyond:begin -->` block); text outside it is kept.
"""
import pathlib
import sys

from ear_jax.experiment import results_md


def main(argv):
  beyond = "--beyond" in argv[1:]
  workdirs = [pathlib.Path(a) for a in argv[1:] if a != "--beyond"]
  if not workdirs:
    print(__doc__)
    return 2
  root, out_root = pathlib.Path("RESULTS.md"), pathlib.Path("results")
  write = results_md.write_beyond_md if beyond else results_md.write_results_md
  write(workdirs, root, out_root)
  print(f"wrote {root} and {out_root}/")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
