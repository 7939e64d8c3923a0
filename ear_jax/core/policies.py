"""Training-slate policies: which slates of a training query the critic is shown (Alg. 1, Table 3).

Symbols: `K` candidates, `s` slate size, `R` slates per training query (`T` for the Explorer, 1
otherwise). A policy (`core.types.TrainSlatePolicy`) maps `(key, relevance [K], gram_fn, where
[K], feedback, config, hparams)` to `[R, s]` slates, masks and labels; `relevance` is a constant
(no gradient flows through slate choice). `TRAIN_SLATES` names them ('none': no training).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ear_jax.core import explorer
from ear_jax.core import losses
from ear_jax.core import slates
from ear_jax.core.config import resolve_strategy
from ear_jax.core.types import TrainSlatePolicy


def explorer_slates(key, relevance, gram_fn, where, feedback, config, hparams):
  """T rounds of Exploratory Reflection (Alg. 2): `R = T` slates, each labelled by the critic."""
  _, k_critic = jax.random.split(key)
  out = explorer.explore(k_critic, relevance, gram_fn(), where, feedback, hparams,
                         config.num_rounds, config.slate_size)
  return out.slates, out.slate_mask, out.labels


def _one_slate(k_critic, slate, slate_mask, feedback):
  labels = jnp.where(slate_mask, feedback(jax.random.split(k_critic, 1)[0], slate, slate_mask),
                     -1.0)
  return slate[None], slate_mask[None], labels[None].astype(jnp.float32)


def adapter_slates(key, relevance, gram_fn, where, feedback, config, hparams):
  """Table 3 'only Experience Buffer': the adapter's top-s slate, one critic call (`R = 1`)."""
  del gram_fn, hparams
  _, k_critic = jax.random.split(key)
  slate, slate_mask = slates.top_s_slate(relevance, where, config.slate_size)
  return _one_slate(k_critic, slate, slate_mask, feedback)


def gumbel_slates(key, relevance, gram_fn, where, feedback, config, hparams):
  """RMM's RL update: a Gumbel top-s sample of `z / tau` (Eq. (19)), one critic call (`R = 1`)."""
  del gram_fn
  k_slate, k_critic = jax.random.split(key)
  slate, slate_mask = losses.gumbel_top_s(k_slate, relevance, where, hparams.tau,
                                          config.slate_size)
  return _one_slate(k_critic, slate, slate_mask, feedback)


TRAIN_SLATES: dict[str, Optional[TrainSlatePolicy]] = {
    "explorer": explorer_slates,
    "adapter": adapter_slates,
    "gumbel": gumbel_slates,
    "none": None,  # no training: Only Retriever / Only Explorer at test
}


def train_slate_policy(value) -> Optional[TrainSlatePolicy]:
  """`EARConfig.train_slate` (a name or a policy) -> the policy (None: 'none')."""
  return resolve_strategy("train_slate", value, TRAIN_SLATES)
