"""An independent, straightforward NumPy implementation of one EAR / RL-update training step.

Written from the paper's equations with plain loops and hand-derived gradients, sharing no code
with `ear_jax`: the oracle of `tests/test_numpy_reference.py` (fed identical draws through
`Randoms` / `draw_randoms`).
"""
from __future__ import annotations

import dataclasses
from typing import List

import numpy as np

EPS = 1e-12


@dataclasses.dataclass
class Randoms:
  critic_u: np.ndarray  # [R, s] uniforms for the critic of each training slate
  slate_gumbel: np.ndarray  # [K] Gumbel noise for the RL slate
  select_u: np.ndarray  # [C] uniforms for 'random' replay selection
  replay_gumbel: np.ndarray  # [B, K] Gumbel noise for the replay slates


def draw_randoms(key, config) -> Randoms:
  """The draws the JAX `query_loss` makes from one query key (mirrors its key splitting)."""
  import jax  # only for reproducing the JAX draws in tests
  k_train, k_replay = jax.random.split(key)
  k_slate, k_critic = jax.random.split(k_train)
  r = config.num_rounds if config.to_dict()["train_slate"] == "explorer" else 1
  s, k = config.slate_size, config.num_candidates
  round_keys = jax.random.split(k_critic, r)
  critic_u = np.stack([np.asarray(jax.random.uniform(rk, (s,))) for rk in round_keys])
  k_select, k_gumbel = jax.random.split(k_replay)
  return Randoms(
      critic_u=critic_u,
      slate_gumbel=np.asarray(jax.random.gumbel(k_slate, (k,))),
      select_u=np.asarray(jax.random.uniform(k_select, (config.buffer_capacity,))),
      replay_gumbel=np.stack([np.asarray(jax.random.gumbel(gk, (k,)))
                              for gk in jax.random.split(k_gumbel, config.replay_size)]))


def init_numpy_state(config):
  """Zero adapters, zero Adam moments and an empty ring buffer of `config.buffer_capacity`."""
  d, c, k = config.dim, config.buffer_capacity, config.num_candidates
  zeros = lambda: np.zeros((d, d))
  return dict(wq=zeros(), wm=zeros(), mq=zeros(), mm=zeros(), vq=zeros(), vm=zeros(), t=0,
              buf_q=np.zeros((c, d)), buf_c=np.zeros((c, k, d)), buf_mask=np.zeros((c, k), bool),
              buf_obs=np.zeros((c, k), bool), buf_ybar=np.zeros((c, k)),
              buf_valid=np.zeros(c, bool), buf_next=0)


def _normalize(u):
  n2 = max(float(u @ u), EPS)
  return u / np.sqrt(n2), np.sqrt(n2)


def _forward(wq, wm, q, cands):
  """Adapted query/candidates (Eq. 3) and logits (Eq. 4), with what the backward pass needs."""
  qt, qn = _normalize(q + wq @ q)
  mts, mns = [], []
  for m in cands:
    mt, mn = _normalize(m + wm @ m)
    mts.append(mt)
    mns.append(mn)
  mts = np.array(mts)
  return qt, qn, mts, np.array(mns), mts @ qt


def _backward(grad_z, q, cands, qt, qn, mts, mns):
  """dL/dW_q and dL/dW_m from dL/dz (chain rule through Eq. 4 and the normalisation of Eq. 3)."""
  g_qt = grad_z @ mts
  g_u = (g_qt - (g_qt @ qt) * qt) / qn
  gwq = np.outer(g_u, q)
  gwm = np.zeros((q.shape[0], q.shape[0]))
  for i in range(len(cands)):
    g_mt = grad_z[i] * qt
    g_v = (g_mt - (g_mt @ mts[i]) * mts[i]) / mns[i]
    gwm += np.outer(g_v, cands[i])
  return gwq, gwm


def _softmax(x, valid):
  x = np.where(valid, x, -np.inf)
  e = np.exp(x - x[valid].max()) if valid.any() else np.zeros_like(x)
  e = np.where(valid, e, 0.0)
  return e / max(e.sum(), 1e-30)


def _rank_loss_and_grad(z, valid, slates, rewards, counted, b, form):
  """Loss -1/n sum (r - b) log p(i) over counted positions, and dL/dz (Eq. 10)."""
  k = len(z)
  loss, grad, n = 0.0, np.zeros(k), 0
  for slate, rew, cnt in zip(slates, rewards, counted):
    chosen = np.zeros(k, bool)
    for i, r, c in zip(slate, rew, cnt):
      avail = valid if form == "flat" else valid & ~chosen
      p = _softmax(z, avail)
      if c:
        lp = z[i] - np.log(np.sum(np.exp(z[avail] - z[avail].max()))) - z[avail].max()
        loss += (r - b) * lp
        onehot = np.zeros(k)
        onehot[i] = 1.0
        grad += (r - b) * (onehot - p)
        n += 1
      chosen[i] = True
  if n == 0:
    return 0.0, np.zeros(k)
  return -loss / n, -grad / n


def _critic(gold_flags, u, precision, recall):
  n = int(np.sum(gold_flags))
  other = len(gold_flags) - n
  p_fp = 0.0
  if n > 0 and other > 0:
    p_fp = min(max(n * recall * (1 - precision) / (other * precision), 0.0), 1.0)
  return np.array([1.0 if (u[j] < (recall if g else p_fp)) else -1.0
                   for j, g in enumerate(gold_flags)])


def _explore(z, mts, valid, gold, critic_u, config, hp):
  k, s = len(z), config.slate_size
  mean, count = np.zeros(k), np.zeros(k)
  slates, labels = [], []
  for t in range(config.num_rounds):
    ucb = mean + hp["alpha"] * np.sqrt(np.log(1 + count.sum()) / (1 + count))
    slate = []
    for _ in range(min(s, int(valid.sum()))):
      best, best_i = -np.inf, -1
      for i in range(k):
        if not valid[i] or i in slate:
          continue
        div = max(mts[i] @ mts[l] for l in slate) if slate else 0.0
        a = hp["lambda_rel"] * z[i] - hp["lambda_div"] * div + hp["lambda_exp"] * ucb[i]
        if a > best:
          best, best_i = a, i
      slate.append(best_i)
    y = _critic([gold[i] for i in slate], critic_u[t], hp["critic_precision"],
                hp["critic_recall"])
    for i, yi in zip(slate, y):
      count[i] += 1
      mean[i] += (yi - mean[i]) / count[i]
    slates.append(slate)
    labels.append(y)
  return slates, labels


def _top(scores, valid, s):
  order = sorted([i for i in range(len(scores)) if valid[i]], key=lambda i: (-scores[i], i))
  return order[:s]


def _support(valid, observed, config):
  """The candidates the loss's softmax runs over (`config.loss_support`), written out."""
  k, window = len(valid), config.num_rounds * config.slate_size
  if config.loss_support == "all" or (config.loss_support in ("window", "auto") and k <= window):
    return valid
  if config.loss_support == "window":
    return np.asarray([bool(valid[i]) and (i < window or bool(observed[i])) for i in range(k)])
  return np.asarray([bool(valid[i]) and bool(observed[i]) for i in range(k)])


def _query(state, q, cands, valid, gold, rnd: Randoms, config, hp):
  """Loss, gradients and the experience of one query against the state at the batch's start."""
  s, k, rule = config.slate_size, config.num_candidates, config.to_dict()["train_slate"]
  qt, qn, mts, mns, z = _forward(state["wq"], state["wm"], q, cands)
  if rule == "explorer":
    slates, labels = _explore(z, mts, valid, gold, rnd.critic_u, config, hp)
  else:
    slate = _top(z if rule == "adapter" else z / hp["tau"] + rnd.slate_gumbel, valid, s)
    slates = [slate]
    labels = [_critic([gold[i] for i in slate], rnd.critic_u[0], hp["critic_precision"],
                      hp["critic_recall"])]
  # Eq. 11-12
  ybar, cnt = np.zeros(k), np.zeros(k)
  for slate, y in zip(slates, labels):
    for i, yi in zip(slate, y):
      cnt[i] += 1
      ybar[i] += yi
  obs = cnt > 0
  ybar = np.where(obs, ybar / np.maximum(cnt, 1), 0.0)
  zl = z / hp["tau"] if config.loss_on_tempered_logits else z
  loss_cur, gz = _rank_loss_and_grad(zl, _support(valid, obs, config), slates, labels,
                                     [[True] * len(x) for x in slates], hp["baseline"],
                                     config.loss_form)
  if config.loss_on_tempered_logits:
    gz = gz / hp["tau"]
  gwq, gwm = _backward(gz, q, cands, qt, qn, mts, mns)
  loss_rep = 0.0
  if config.use_replay:
    bv, strategy = state["buf_valid"], config.to_dict()["replay_strategy"]
    if strategy == "similarity":
      score = state["buf_q"] @ q
    elif strategy == "reward":
      score = -np.array([(state["buf_ybar"][c][state["buf_obs"][c]].sum() /
                          max(state["buf_obs"][c].sum(), 1)) for c in range(len(bv))])
    else:
      score = rnd.select_u
    chosen = _top(score, bv, config.replay_size)
    rep_losses = []
    rwq, rwm = np.zeros_like(gwq), np.zeros_like(gwm)
    for slot, c in enumerate(chosen):
      rq, rc, rmask = state["buf_q"][c], state["buf_c"][c], state["buf_mask"][c]
      qt2, qn2, mts2, mns2, z2 = _forward(state["wq"], state["wm"], rq, rc)
      yb, ob = state["buf_ybar"][c], state["buf_obs"][c]
      rmask = _support(rmask, ob, config)
      slate = _top(z2 / hp["tau"] + rnd.replay_gumbel[slot], rmask, s)
      rew = [1.0 if yb[i] > 0 else -1.0 for i in slate]
      counted = [True if config.replay_unobserved == "negative" else bool(ob[i]) for i in slate]
      l, g = _rank_loss_and_grad(z2, rmask, [slate], [rew], [counted], hp["baseline"],
                                 config.loss_form)
      a, bb = _backward(g, rq, rc, qt2, qn2, mts2, mns2)
      rep_losses.append(l)
      rwq += a
      rwm += bb
    if chosen:
      loss_rep = float(np.mean(rep_losses))
      gwq += hp["lambda_rep"] * rwq / len(chosen)
      gwm += hp["lambda_rep"] * rwm / len(chosen)
  loss = loss_cur + hp["lambda_rep"] * loss_rep
  return dict(loss=loss, loss_cur=loss_cur, loss_rep=loss_rep, gwq=gwq, gwm=gwm, slates=slates,
              labels=labels, obs=obs, ybar=ybar)


def numpy_train_batch(state, batch, randoms: List[Randoms], config, hp):
  """One EAR (or RL-update) step on a batch: mean gradient, one Adam/SGD step, push experiences.

  Args:
    state: dict from `init_numpy_state`; its buffer arrays are updated in place, the weights and
      Adam moments of the returned dict are new.
    batch: `queries [b,d]`, `candidates [b,K,d]`, `mask [b,K]`, `gold [b,K]` numpy arrays.
    randoms: one `Randoms` per query of the batch.
    config: an `EARConfig`.
    hp: dict of hyperparameters (floats).
  """
  state = dict(state)  # the weights are rebound below; the buffer arrays are written in place
  outs = [_query(state, batch["queries"][i], batch["candidates"][i], batch["mask"][i],
                 batch["gold"][i], randoms[i], config, hp) for i in range(len(randoms))]
  gwq = sum(o["gwq"] for o in outs) / len(outs)
  gwm = sum(o["gwm"] for o in outs) / len(outs)
  lr = hp["learning_rate"]
  if config.to_dict()["optimizer"] == "adam":
    b1, b2, eps = 0.9, 0.999, 1e-8
    state["t"] += 1
    t = state["t"]
    for w, m, v, g in (("wq", "mq", "vq", gwq), ("wm", "mm", "vm", gwm)):
      state[m] = b1 * state[m] + (1 - b1) * g
      state[v] = b2 * state[v] + (1 - b2) * g * g
      mhat = state[m] / (1 - b1 ** t)
      vhat = state[v] / (1 - b2 ** t)
      state[w] = state[w] - lr * mhat / (np.sqrt(vhat) + eps)
  else:
    state["wq"] = state["wq"] - lr * gwq
    state["wm"] = state["wm"] - lr * gwm
  cap = len(state["buf_valid"])
  for i, o in enumerate(outs):
    c = state["buf_next"]
    state["buf_q"][c] = batch["queries"][i]
    state["buf_c"][c] = batch["candidates"][i]
    state["buf_mask"][c] = batch["mask"][i]
    state["buf_obs"][c] = o["obs"]
    state["buf_ybar"][c] = o["ybar"]
    state["buf_valid"][c] = True
    state["buf_next"] = (c + 1) % cap
  return state, outs


def hp_dict(hparams, critic=None):
  """`HParams` and the simulated critic's parameters (default: the paper's) -> dict of floats."""
  from ear_jax.core import critic as critic_lib  # the default critic's values
  critic = critic_lib.or_default(critic)
  return {**{f.name: float(getattr(hparams, f.name)) for f in dataclasses.fields(hparams)},
          "critic_precision": float(critic.precision), "critic_recall": float(critic.recall)}
