"""Assembles RESULTS.md from the workdirs of `experiments.run` (tables, plots, commands, timings).

  python -m experiments.results_md runs/locomo_main [runs/longmemeval_all ...]

Copies each workdir's plots to results/<benchmark>/ and rewrites the block between the
`<!-- generated:begin -->` / `<!-- generated:end -->` markers of RESULTS.md; text outside the block
(the written reading of the numbers) is kept.
"""
import json
import pathlib
import shutil
import sys

BEGIN, END = "<!-- generated:begin -->", "<!-- generated:end -->"


def section(workdir: pathlib.Path, out_root: pathlib.Path) -> str:
  res = json.loads((workdir / "results.json").read_text())
  bench = res["benchmark"]
  dest = out_root / bench
  dest.mkdir(parents=True, exist_ok=True)
  lines = [f"## {bench}", "", "Command:", "", "```", res["command"], "```", "",
           f"Seeds: {res['seeds']}; encoder: {res['dataset'].get('encoding', {}).get('encoder')}; "
           f"versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()), "",
           "Wall time per suite (s, this machine, shared CPUs): " + ", ".join(
               f"{k} {v}" for k, v in res["suite_wall_seconds"].items()), ""]
  for name, md in res["tables"].items():
    lines += [md.replace("### ", "### "), ""]
  for p in res["plots"]:
    src = pathlib.Path(p)
    if not src.is_absolute():
      src = pathlib.Path.cwd() / src
    if src.is_file():
      shutil.copy(src, dest / src.name)
      lines.append(f"![{src.stem}]({dest.relative_to(out_root.parent)}/{src.name})")
  return "\n".join(lines) + "\n"


def main(argv):
  workdirs = [pathlib.Path(a) for a in argv[1:]]
  if not workdirs:
    print(__doc__)
    return 2
  root = pathlib.Path("RESULTS.md")
  out_root = pathlib.Path("results")
  gen = BEGIN + "\n" + "\n".join(section(w, out_root) for w in workdirs) + END
  if root.is_file() and BEGIN in root.read_text():
    text = root.read_text()
    text = text[:text.index(BEGIN)] + gen + text[text.index(END) + len(END):]
  else:
    text = "# Results\n\n" + gen + "\n"
  root.write_text(text)
  print(f"wrote {root} and {out_root}/")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
