"""A probe, not part of the library (session 15, issue 27's strength target): do features that the
first stage cannot see raise the gold-label held-out bound of `--suite=headroom` over hybrid?

Usage (LoCoMo validation only; the test split is never read):
  EAR_DATA_DIR=../shared/data python docs/probes/context_features_headroom.py locomo [SET ...]
SET in base, pos, meta, ctx, meta+pos, spk, ctx+spk, adj+spk, lib (default: all; lib is the
library's `--features=context`, session 17). With `--online`,
each set instead trains the `ear_tuned` preset online from the simulated critic on the fit part
and reports adapter-only Recall@5 on validation against the frozen first stage, paired per seed
(`PROBE_LR=<lr>` overrides the preset's learning rate). Per candidate, computed here on the host from
the benchmark's candidate ids and texts (LoCoMo ids `D<session>:<turn>`):
  recency    the candidate's session number / the conversation's last session;
  same_sess  other candidates of the same session / K;
  adj        (turn - 1 in the candidates) + (turn + 1 in the candidates), / 2;
  spk        the candidate's speaker (text before ':') appears in the question;
  pos        1 / (1 + first-stage position).
Each set is appended to the hybrid side features (its weights start at 0, so step 0 is the first
stage) and fitted on gold labels with the headroom suite's grid (`suites/headroom.py`): all
parameters, and the side weights alone. ~4 min per set on 2 cores.
"""
import os, re, sys, numpy as np, jax, jax.numpy as jnp
from ear_jax.experiment import suites, runner
from ear_jax.experiment.suites import headroom as H
from ear_jax.experiment.suites.first_stage import sub_runner, _validation
from ear_jax.experiment.suites.run_cache import Runner
from ear_jax.core import adapter as adapter_lib
from ear_jax.core import guard as guard_lib

bench_name = sys.argv[1]
opts = suites.Options(benchmark=bench_name, data_dir=os.environ.get("EAR_DATA_DIR", "../shared/data"), seeds=5,
                      workdir=f"runs/probe_context_{bench_name}", suite="headroom", checkpoint_every=None, progress=False)
r = Runner(opts)
sub = sub_runner(r, "hybrid")
b = sub.bench()
stream = b.stream
fit_i, val_i = _validation(sub)
F, d = stream.num_side_features, stream.dim
c = np.asarray(stream.candidates); mask = np.asarray(stream.mask); N, K = mask.shape
print("stream", c.shape, F, "ids", b.candidate_ids[0, :3], flush=True)
ids = b.candidate_ids
def sess_turn(x):
  m = re.match(r"^[A-Za-z]*(\d+):(\d+)$", x)
  return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)
st = np.array([[sess_turn(x) if x else (-1, -1) for x in row] for row in ids])  # [N,K,2]
sess, turn = st[..., 0].astype(float), st[..., 1].astype(float)
# per-group max session
maxs = {}
for g, row in zip(b.group, sess):
  maxs[g] = max(maxs.get(g, 1), row.max())
ms = np.array([maxs[g] for g in b.group])[:, None]
recency = np.where(mask, sess / np.maximum(ms, 1), 0)
same_sess = np.array([[((row == s) & m).sum() - 1 if m0 else 0 for s, m0 in zip(row, m)]
                      for row, m in zip(sess, mask)]) / K
adj = np.zeros((N, K))
for n in range(N):
  keyset = {(s, t) for s, t, m0 in zip(sess[n], turn[n], mask[n]) if m0}
  for j in range(K):
    if mask[n, j]:
      adj[n, j] = ((sess[n, j], turn[n, j] - 1) in keyset) + ((sess[n, j], turn[n, j] + 1) in keyset)
adj /= 2
spk = np.zeros((N, K))
for n in range(N):
  ql = b.query_texts[n].lower()
  for j in range(K):
    t = b.candidate_texts[n, j]
    if mask[n, j] and ":" in t:
      spk[n, j] = float(t.split(":", 1)[0].strip().lower() in ql)
pos = np.where(mask, 1.0 / (1 + np.arange(K))[None], 0.0)
print("feature means (valid):", {k: float(v[mask].mean()) for k, v in
      dict(recency=recency, same_sess=same_sess, adj=adj, spk=spk).items()}, flush=True)
g = np.asarray(stream.gold)
for k, v in dict(recency=recency, same_sess=same_sess, adj=adj, spk=spk).items():
  print(f"  {k}: mean on gold {v[g & mask].mean():.3f} non-gold {v[~g & mask].mean():.3f}")
E = lambda *xs: [np.where(mask, x, 0).astype(np.float32) for x in xs]
extras = {"base": [], "pos": E(pos), "meta": E(recency, same_sess, adj, spk),
          "meta+pos": E(recency, same_sess, adj, spk, pos), "ctx": E(same_sess, adj),
          "spk": E(spk), "ctx+spk": E(same_sess, adj, spk), "adj+spk": E(adj, spk)}
# "lib": the library's own context features (`--features=context`, first_stage.CONTEXT_FEATURES,
# session 17), built by the pipeline instead of here; the same queries, so the same splits.
online = "--online" in sys.argv
which = [a for a in sys.argv[2:] if a != "--online"] or list(extras)
extras["lib"] = None
for name in which:
  ex = extras[name]
  if name == "lib":
    lb = sub_runner(r, "hybrid", features="context").bench()
    assert list(lb.query_ids) == list(b.query_ids)
    s2 = lb.stream.replace(answer_support=None)
    n_side = s2.num_side_features
    print("lib features vs probe's ctx+spk: max |diff|", float(np.abs(
        np.asarray(s2.candidates)[..., d + F:] - np.stack(extras["ctx+spk"], -1)).max()), flush=True)
  else:
    cc = np.concatenate([c] + [e[..., None] for e in ex], -1) if ex else c
    s2 = stream.replace(candidates=jnp.asarray(cc), answer_support=None)
    n_side = F + len(ex)
  m = runner.build_method("ear_tuned", dim=d, num_candidates=K, side_features=n_side)
  if online:  # the preset learning online from the simulated critic, fit -> validation, paired
    lr = os.environ.get("PROBE_LR")  # validation only: the preset's learning rate, overridden
    if lr:
      m = m._replace(hparams=m.hparams.replace(learning_rate=jnp.float32(float(lr))))
    res = runner.train_and_evaluate(f"probe {name}", s2, fit_i, val_i, m.config, m.hparams,
                                    sub.seeds)
    first = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (len(sub.seeds),) + x.shape),
                                   guard_lib.first_stage_params(m.config))
    frozen = runner.evaluate_params(first, s2, val_i, m.config, m.hparams, sub.seeds)
    a = 100 * np.asarray(res.eval["recall_adapter"], np.float64)
    f = 100 * np.asarray(frozen["recall_adapter"], np.float64)
    print(f"{name:10s} online ear_tuned: frozen {f.mean():.2f} adapter-only {a.mean():.2f} "
          f"(+{(a - f).mean():.2f}; per seed {np.round(a - f, 2).tolist()})", flush=True)
    continue
  p0 = adapter_lib.init_adapter(jax.random.PRNGKey(0), m.config)
  part = lambda i: runner.stack_streams(s2, i)
  fp, vp = part(fit_i), part(val_i)
  for fields, lrs, betas, tag in [((), (3e-5, 1e-4), (64.0,), "all"),
                                   (("w_q", "w_m", "a_q", "a_m"), (1e-2,), (64.0,), "side")]:
    fields = tuple(x for x in fields if getattr(p0, x) is not None)
    held = H._fit_grid(fp, vp, p0, fields, lrs, betas)
    best, at = H._best(held)
    frozen0 = held[list(held)[0]].held_out[:, 0]
    print(f"{name:10s} {tag}: frozen {frozen0.mean():.2f} held-out {best.mean():.2f} "
          f"(+{(best - frozen0).mean():.2f}) at {at}", flush=True)
