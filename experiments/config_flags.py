"""Command-line flags generated from the fields of `EARConfig` and `HParams` (and the critic's).

One flag per field, its help the field's `Attributes:` entry (`EARConfig`) or comment (`HParams`),
its bounds checked by absl validators, default None (the method's value). `SET_BY_DATA` fields are
not flags.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import typing

from absl import flags

from ear_jax.core import buffer
from ear_jax.core import config as config_lib
from ear_jax.core import critic as critic_lib
from ear_jax.core import policies

SET_BY_DATA = ("dim", "num_candidates", "side_features")

# Discrete fields -> their choices (a strategy's choices are its registry's names).
_CHOICES = {
    "train_slate": lambda: list(policies.TRAIN_SLATES),
    "replay_strategy": lambda: list(buffer.REPLAY_STRATEGIES),
    "optimizer": lambda: list(config_lib.OPTIMIZERS),
    "loss_form": lambda: list(config_lib.LOSS_FORMS),
    "replay_unobserved": lambda: list(config_lib.REPLAY_UNOBSERVED),
    "final_slate": lambda: list(config_lib.FINAL_SLATES),
}
# Other fields: the flag of the first type here their annotation names (`EARConfig` checks str).
_DEFINES = ((bool, flags.DEFINE_bool), (int, flags.DEFINE_integer), (float, flags.DEFINE_float),
            (str, flags.DEFINE_string))
# Bounds checked by absl validators: (lower bound, inclusive?).
_BOUNDS = {
    "slate_size": (1, True), "num_rounds": (1, True), "replay_size": (1, True),
    "buffer_capacity": (1, True), "batch_size": (1, True), "test_rounds": (1, True),
    "side_init": (0.0, True), "tau": (0.0, False), "learning_rate": (0.0, True),
    "lambda_rep": (0.0, True), "alpha": (0.0, True), "guard_z": (0.0, True),
    "guard_min_queries": (1, True), "guard_holdout": (0, True), "guard_holdout_capacity": (1, True),
}


def _docstring_attributes(cls) -> dict:
  """`{name: text}` of the `Attributes:` section of a Google-style class docstring."""
  doc = inspect.getdoc(cls) or ""
  section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
  out, name = {}, None
  for line in section.splitlines():
    m = re.match(r"^  (\w+): (.*)$", line)
    if m:
      name = m.group(1)
      out[name] = m.group(2).strip()
    elif name and line.startswith("    "):
      out[name] += " " + line.strip()
    elif line.strip() and not line.startswith(" "):
      break
  return out


def _field_comments(cls) -> dict:
  """`{name: comment}` of the `name: type  # comment` lines of a dataclass's source."""
  return {m.group(1): m.group(2).strip()
          for m in re.finditer(r"^\s+(\w+): [^#\n]+#\s*(.+)$", inspect.getsource(cls), re.M)}


def _bound_validator(name, flag_values):
  low, inclusive = _BOUNDS[name]
  op = ">=" if inclusive else ">"
  flags.register_validator(
      name, lambda v: v is None or (v >= low if inclusive else v > low),
      message=f"--{name} must be {op} {low}", flag_values=flag_values)


def define_config_flags(flag_values=flags.FLAGS) -> dict:
  """One flag per `EARConfig` field but `SET_BY_DATA`: `{field: FlagHolder}`."""
  helps = _docstring_attributes(config_lib.EARConfig)
  hints = typing.get_type_hints(config_lib.EARConfig)
  holders = {}
  for f in dataclasses.fields(config_lib.EARConfig):
    if f.name in SET_BY_DATA:
      continue
    text = f"EARConfig.{f.name}: {helps.get(f.name, '')} (default: the method's)"
    kind = hints[f.name]
    if f.name in _CHOICES:
      holders[f.name] = flags.DEFINE_enum(f.name, None, _CHOICES[f.name](), text,
                                          flag_values=flag_values)
    else:
      define = next((d for t, d in _DEFINES if t in (kind, *typing.get_args(kind))), None)
      if define is None:  # a new field: add its type to `_DEFINES`
        raise TypeError(f"EARConfig.{f.name}: no flag type for {kind}")
      holders[f.name] = define(f.name, None, text, flag_values=flag_values)
    if f.name in _BOUNDS:
      _bound_validator(f.name, flag_values)
  return holders


def define_hparam_flags(flag_values=flags.FLAGS) -> dict:
  """One float flag per `HParams` field: `{field: FlagHolder}` (None = the method's value)."""
  comments = _field_comments(config_lib.HParams)
  holders = {}
  for name, default in config_lib.HPARAM_DEFAULTS.items():
    what = re.sub(r"^\[\] float32, ", "", comments.get(name, ""))
    holders[name] = flags.DEFINE_float(
        name, None, f"HParams.{name}: {what} (the paper's: {default}; default: the method's).",
        flag_values=flag_values)
    if name in _BOUNDS:
      _bound_validator(name, flag_values)
  return holders


def overrides(holders: dict) -> dict:
  """`{field: value}` of the flags that were set."""
  return {k: f.value for k, f in holders.items() if f.value is not None}


def define_critic_flags() -> dict:
  """--critic_precision / --critic_recall of the simulated critic (Appendix A.2; None: the
  paper's): `{"precision" | "recall": FlagHolder}`."""
  return {
      "precision": flags.DEFINE_float(
          "critic_precision", None, f"Simulated critic precision p (default "
          f"{critic_lib.DEFAULT_PRECISION}).", lower_bound=0.0, upper_bound=1.0),
      "recall": flags.DEFINE_float(
          "critic_recall", None, f"Simulated critic recall r (default "
          f"{critic_lib.DEFAULT_RECALL}).", lower_bound=0.0, upper_bound=1.0)}
