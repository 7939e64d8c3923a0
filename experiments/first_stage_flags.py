"""The first-stage flags shared by the experiment programs: the candidate generator, the hybrid
fusion, and whether the first stage's scores reach EAR as side information.
"""
from typing import NamedTuple

from absl import app
from absl import flags

from ear_jax.data import first_stage


class FirstStageFlags(NamedTuple):
  candidates: flags.FlagHolder
  side_features: flags.FlagHolder
  fusion: flags.FlagHolder
  lexical_weight: flags.FlagHolder


def define() -> FirstStageFlags:
  """Defines --candidates, --side_features, --fusion and --lexical_weight."""
  return FirstStageFlags(
      candidates=flags.DEFINE_enum(
          "candidates", "dense", list(first_stage.GENERATORS),
          "First stage that retrieves the K candidates: dense (the frozen encoder's cosine, the "
          "paper), bm25 (BM25 over the bank's texts, bm25s) or hybrid (a fusion of both)."),
      side_features=flags.DEFINE_bool(
          "side_features", None, "Give EAR the first stage's scores as side information "
          "(z = adapted cosine + w . features). Default: on for bm25 / hybrid, off for dense."),
      fusion=flags.DEFINE_enum(
          "fusion", None, list(first_stage.FUSIONS), "Hybrid fusion: rrf (reciprocal-rank "
          f"fusion) or weighted (a weighted sum of min-max normalised scores). Default: "
          f"{first_stage.FirstStageOptions().fusion}."),
      lexical_weight=flags.DEFINE_float(
          "lexical_weight", None, "Hybrid 'weighted' fusion: the BM25 share in [0, 1] (chosen on "
          f"LoCoMo validation; default {first_stage.FirstStageOptions().lexical_weight}).",
          lower_bound=0.0, upper_bound=1.0))


def options(fs: FirstStageFlags) -> dict:
  """`{candidates, side_features, fusion, lexical_weight}` from the flags.

  Raises:
    app.UsageError: --fusion / --lexical_weight without --candidates=hybrid.
  """
  if fs.candidates.value != "hybrid":
    for holder in (fs.fusion, fs.lexical_weight):
      if holder.value is not None:
        raise app.UsageError(f"--{holder.name} applies to --candidates=hybrid only")
  return {"candidates": fs.candidates.value, "side_features": fs.side_features.value,
          "fusion": fs.fusion.value, "lexical_weight": fs.lexical_weight.value}
