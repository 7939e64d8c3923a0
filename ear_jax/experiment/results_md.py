"""RESULTS.md from the workdirs of `experiments.run`: tables, readings, plots, commands, timings.

`write_results_md` copies each workdir's plots to `<out_root>/<benchmark>/` and rewrites only the
block between the `<!-- generated:begin -->` / `<!-- generated:end -->` markers; text outside it
is kept. Each suite's "Readings" state every primary paired comparison (mean difference, 95%
t-interval over seeds, verdict, agreement with the paper's direction).
"""
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Sequence

from ear_jax.experiment import stats

BEGIN, END = "<!-- generated:begin -->", "<!-- generated:end -->"

_VS_PAPER = {"holds": "the paper's direction holds", "opposite": "opposite to the paper",
             "not separated": "the paper's ordering is not separated here"}


def _side(s: dict) -> str:
  return f"{s['label']} [{s['mode']}]" if s.get("mode") else s["label"]


def reading(rec: dict) -> str:
  """One line reading a results.json "paired" record (`suites.pairing.pair`), e.g.
  'EAR [explorer] vs Only Retriever [adapter], R@5: +3.80 [+1.20, +6.40]: better (interval
  excludes 0); paper +12.46 → the paper's direction holds'."""
  line = (f"{_side(rec['treatment'])} vs {_side(rec['baseline'])}, {rec['metric']}: "
          f"{stats.format_difference(rec)}: "
          f"{stats.describe_verdict(rec, neutral=rec.get('score') is False)}")
  vs = rec.get("vs_paper")
  if vs:
    paper = rec.get("paper_delta")
    ref = f"paper {paper:+.2f}" if paper is not None else (
        "paper: " + ("higher" if (rec.get("expected_sign") or 0) > 0 else "lower"))
    line += f"; {ref} → {_VS_PAPER.get(vs, vs)}"
  return line


def readings_md(records: list, primary_only: bool = True) -> str:
  """Markdown "Readings" list of a suite's paired comparisons ('' when there are none)."""
  recs = [r for r in records if r.get("primary") or not primary_only]
  if not recs:
    return ""
  n = sorted({r["n"] for r in recs})
  head = (f"Readings (paired per-seed differences, mean [{stats.INTERVAL_LABEL}], n = "
          f"{', '.join(map(str, n))}; an interval containing 0 is a tie):")
  return "\n".join([head, ""] + [f"- {reading(r)}" for r in recs])


def section(workdir: pathlib.Path, out_root: pathlib.Path, title: str | None = None,
            level: int = 2) -> str:
  """The markdown section of one workdir (heading `level`, default title the benchmark); copies
  its plots to `out_root/<benchmark>/`."""
  res = json.loads((workdir / "results.json").read_text())
  bench = res["benchmark"]
  dest = out_root / bench
  dest.mkdir(parents=True, exist_ok=True)
  lines = ["#" * level + f" {title or bench}", "", "Command:", "", "```", res["command"], "```", "",
           f"Seeds: {res['seeds']}; encoder: {res['dataset'].get('encoding', {}).get('encoder')}; "
           f"versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()), "",
           "Wall time per suite (s, this machine, shared CPUs): " + ", ".join(
               f"{k} {v}" for k, v in res["suite_wall_seconds"].items()), ""]
  paired = res.get("paired", {})
  for name, md in res["tables"].items():
    lines += [md, ""]
    readings = readings_md(paired.get(name, []))
    if readings:
      lines += [readings, ""]
  for p in res["plots"]:
    src = pathlib.Path(p)
    if src.is_file():
      shutil.copy(src, dest / src.name)
      lines.append(f"![{src.stem}]({dest.relative_to(out_root.parent)}/{src.name})")
  return "\n".join(lines) + "\n"


def write_results_md(workdirs: Sequence[pathlib.Path],
                     root: pathlib.Path = pathlib.Path("RESULTS.md"),
                     out_root: pathlib.Path = pathlib.Path("results")) -> None:
  """Writes the generated block of `root` (created when missing) and the plots under `out_root`
  from `workdirs`."""
  gen = BEGIN + "\n" + "\n".join(section(pathlib.Path(w), out_root) for w in workdirs) + END
  if root.is_file() and BEGIN in root.read_text():
    text = root.read_text()
    text = text[:text.index(BEGIN)] + gen + text[text.index(END) + len(END):]
  else:
    text = "# Results\n\n" + gen + "\n"
  root.write_text(text)


# The "Beyond the paper" block, generated from `--suite=tune` / `--suite=beyond` workdirs.
BEYOND_BEGIN, BEYOND_END = "<!-- beyond:begin -->", "<!-- beyond:end -->"


def write_beyond_md(workdirs: Sequence[pathlib.Path],
                    root: pathlib.Path = pathlib.Path("RESULTS.md"),
                    out_root: pathlib.Path = pathlib.Path("results")) -> None:
  """Rewrites RESULTS.md's "Beyond the paper" block (appended when missing) from tune / beyond
  workdirs; plots go under `out_root`."""
  parts = []
  for w in workdirs:
    res = json.loads((pathlib.Path(w) / "results.json").read_text())
    what = {"tune": "validation tuning", "beyond": "test split"}.get(res.get("suite"),
                                                                    res.get("suite") or "run")
    parts.append(section(pathlib.Path(w), out_root, title=f"{res['benchmark']}: {what}",
                         level=3))
  gen = BEYOND_BEGIN + "\n" + "\n".join(parts) + BEYOND_END
  text = root.read_text() if root.is_file() else "# Results\n"
  if BEYOND_BEGIN in text:
    text = text[:text.index(BEYOND_BEGIN)] + gen + text[text.index(BEYOND_END) + len(BEYOND_END):]
  else:
    text = text.rstrip("\n") + "\n\n## Beyond the paper\n\n" + gen + "\n"
  root.write_text(text)
