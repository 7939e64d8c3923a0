"""The accelerator run's targets, its markdown table, and BENCHMARKS.md's "GPU" section.

`targets(result)`: vmapped seeds against the host CPU (target >= 50x) and exact search against the
bandwidth bound (target <= 2x).
"""
from __future__ import annotations

import pathlib

TARGETS = {"seeds_speedup_vs_cpu": 50.0, "search_ratio_to_bound": 2.0}
HEADING = "## GPU"


def _measured(rows):
  return [r for r in rows if isinstance(r, dict) and r.get("status") == "measured"]


def targets(result: dict) -> dict:
  """The two targets of the accelerator column, each `{value, target, met, what}` or None."""
  out = {"seeds_speedup_vs_cpu": None, "search_ratio_to_bound": []}
  seeds = result.get("seeds", {})
  dev = _measured(seeds.get("device", []))
  cpu = _measured(seeds.get("cpu", [])) if isinstance(seeds.get("cpu"), list) else []
  if dev and cpu:
    top = max(dev, key=lambda r: r["seeds"])
    best_cpu = max(r["episodes_per_s"] for r in cpu)
    v = top["episodes_per_s"] / best_cpu
    out["seeds_speedup_vs_cpu"] = {
        "value": v, "target": TARGETS["seeds_speedup_vs_cpu"],
        "met": v >= TARGETS["seeds_speedup_vs_cpu"],
        "what": f"device episodes/s at N = {top['seeds']} / the host CPU's best episodes/s "
                f"(N in {[r['seeds'] for r in cpu]})"}
  rows = _measured(result.get("search", {}).get("rows", []))
  if rows:
    m = max(r["rows"] for r in rows)
    for r in rows:
      if r["rows"] == m and r["batch"] == 64:
        out["search_ratio_to_bound"].append({
            "value": r["ratio_to_bound"], "target": TARGETS["search_ratio_to_bound"],
            "met": r["ratio_to_bound"] <= TARGETS["search_ratio_to_bound"],
            "what": f"{m:,} rows, {r['dtype']}, batch 64, chunk {r['chunk']}"})
  return out


def _fmt_counts(counts: dict) -> str:
  return ", ".join(f"{v} {k}" for k, v in counts.items()) or "no summary line"


def table(result: dict) -> str:
  """The markdown of one accelerator run (what BENCHMARKS.md's GPU section holds)."""
  env = result.get("environment", {})
  v = env.get("versions", {})
  plugin = ", ".join(f"{k} {v[k]}" for k in v if k.startswith(("jax-cuda", "libtpu"))) or "none"
  mem = env.get("device_memory_bytes")
  lines = [
      f"Written by `{result.get('command', '')}` (wall {result.get('wall_s', '?')} s); rerun it to "
      "refresh this section, never edit it by hand.",
      "",
      f"Device: {env.get('device_kind')} x {env.get('device_count')} (backend "
      f"{env.get('backend')}{f', {mem / 2**30:.0f} GiB usable' if mem else ''}); host "
      f"{env.get('host_cpus')} CPUs. jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, plugin: "
      f"{plugin}; flax {v.get('flax')}, optax {v.get('optax')}, orbax-checkpoint "
      f"{v.get('orbax-checkpoint')}, Python {v.get('python')}. Environment: "
      f"{env.get('env') or 'nothing set'}. The seeds and the search run in the bench's own process "
      f"at matmul precision {env.get('matmul_precision_default')} (None: JAX's default, which lets "
      "float32 products use TF32 on recent NVIDIA GPUs and bfloat16 passes on TPU); the tests and "
      "the paper run at the precision stated with them.",
  ]
  t = result.get("tests")
  if t:
    failed = f"; failed: {', '.join(t['failed_tests'][:10])}" if t.get("failed_tests") else ""
    lines += ["", f"**Core tests on the device** ({len(t['files'])} file(s): the test files that "
              f"import only `ear_jax.core`; `JAX_DEFAULT_MATMUL_PRECISION={t['precision']}`): "
              f"{t['status']}, {_fmt_counts(t.get('counts', {}))} in {t.get('seconds')} s"
              f"{failed}. Command: `{t['command']}`."]
  m = result.get("main")
  if m:
    dev = m.get("device", {})
    lines += ["", f"**Paper run on the device**: `python -m experiments.run "
              f"{' '.join(m['args'])}` with `JAX_DEFAULT_MATMUL_PRECISION={m['precision']}`: "
              f"{dev.get('status')}"
              + (f", {dev['wall_s']} s (process)" if dev.get("wall_s") else "")
              + f". CPU reference: {m.get('reference', {}).get('source')}"
              + (f" (`{m['reference']['command']}`" if m.get("reference", {}).get("command")
                 else " (") + f"; jax {(m.get('reference', {}).get('versions') or {}).get('jax')})"
              + f". Tolerance: |device mean - CPU mean| <= {m['tolerance_points']} points over the "
              "seeds; 'equal seeds': per-seed values equal to the 4 decimals results.json keeps."]
    if m.get("rows"):
      lines += ["", "| run | metric | CPU mean | device mean | difference | largest per-seed "
                "difference | equal seeds | within tolerance |", "|---|---|---|---|---|---|---|---|"]
      for r in m["rows"]:
        if r["metric"].startswith("recall_"):
          lines.append(f"| {r['run']} | {r['metric']} | {r['cpu_mean']:.2f} | "
                       f"{r['device_mean']:.2f} | {r['diff']:+.2f} | {r['max_seed_diff']:.2f} | "
                       f"{r['seeds_equal']} / {r['seeds']} | "
                       f"{'yes' if r['within_tolerance'] else 'NO'} |")
    else:
      lines.append(f"Not compared: {m.get('status')}.")
  s = result.get("seeds")
  if s:
    st = s["stream"]
    lines += ["", f"**Seeds in one call**: one jitted `vmap(run_episode)` over N seeds "
              f"(`sharding.unsharded_episodes`), {st['method']}, {st['num_queries']} queries, "
              f"d = {st['dim']}, K = {st['K']} ({st['source']}); minimum over repetitions, "
              "compilation apart.", "",
              "| where | N | seconds | episodes/s | ratio to N = 1 | compile + first call (s) |",
              "|---|---|---|---|---|---|"]
    for where in ("device", "cpu"):
      rows = s.get(where)
      if not isinstance(rows, list):
        continue
      label = env.get("device_kind", "device") if where == "device" else "host CPU"
      for r in rows:
        if r.get("status") != "measured":
          lines.append(f"| {label} | {r['seeds']} | {r['status']} | | | |")
          continue
        ratio = f"{r['ratio_to_1']:.1f}x" if "ratio_to_1" in r else "-"
        lines.append(f"| {label} | {r['seeds']:,} | {r['seconds']:.3f} | "
                     f"{r['episodes_per_s']:.2f} | {ratio} | {r['compile_and_first_s']} |")
  se = result.get("search")
  if se:
    bw = se["bandwidth"]
    lines += ["", f"**Exact candidate search** (`retrieval.top_k_search`, K = {se['k']}, "
              f"d = {se['dim']}, random unit rows): bound = bank bytes / bandwidth, the bandwidth "
              f"measured in this run by a reduction over a resident {bw['bytes'] / 1e9:.2f} GB "
              f"array: {bw['gb_per_s']:.0f} GB/s ({se['bandwidth_after']['gb_per_s']:.0f} GB/s "
              "at the end).", "",
              "| rows | dtype | batch | chunk | ms / call | bound (ms) | ratio to bound | GB/s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in se["rows"]:
      if r.get("status") != "measured":
        lines.append(f"| {r['rows']:,} | {r['dtype']} | {r.get('batch', '')} | "
                     f"{r.get('chunk') or ''} | {r['status']} | | | |")
        continue
      lines.append(f"| {r['rows']:,} | {r['dtype']} | {r['batch']} | {r['chunk']:,} | "
                   f"{r['ms']:.3f} | {r['bound_ms']:.3f} | {r['ratio_to_bound']:.2f} | "
                   f"{r['gb_per_s']:.0f} |")
  tg = result.get("targets") or targets(result)
  items = ([tg["seeds_speedup_vs_cpu"]] if tg.get("seeds_speedup_vs_cpu") else []) + \
      list(tg.get("search_ratio_to_bound", []))
  if items:
    lines += ["", "| target | value | needed | met |", "|---|---|---|---|"]
    sp = tg.get("seeds_speedup_vs_cpu")
    if sp:
      lines.append(f"| vmapped seeds: {sp['what']} | {sp['value']:.1f}x | >= {sp['target']:.0f}x "
                   f"| {'yes' if sp['met'] else 'NO'} |")
    for r in tg.get("search_ratio_to_bound", []):
      lines.append(f"| exact search: {r['what']} | {r['value']:.2f}x the bound | <= "
                   f"{r['target']:.0f}x | {'yes' if r['met'] else 'NO'} |")
  return "\n".join(lines)


def write_section(path, text: str, heading: str = HEADING) -> None:
  """Replaces the body of `path`'s `heading` section with `text`, or appends the section."""
  path = pathlib.Path(path)
  lines = path.read_text().splitlines()
  body = [heading, "", *text.splitlines(), ""]
  if heading in lines:
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    lines[start:end] = body
  else:
    lines += ["", *body]
  path.write_text("\n".join(lines).rstrip("\n") + "\n")
