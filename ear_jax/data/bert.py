"""A BERT-family text encoder in Flax (BERT, RoBERTa, XLM-RoBERTa): config, module and weights.

Symbols: `B` batch size, `L` padded token length, `h` hidden size, `H` attention heads.

`check_config` reads a checkpoint's `config.json` into a `BertConfig`, naming what is unsupported;
`load` reads its weights (safetensors, Flax msgpack, or `pytorch_model.bin` with torch) into a tree
named as the checkpoint's Flax form, the pooler head left out; `hidden_states` is the last hidden
layer. Post-LayerNorm BERT arithmetic; RoBERTa and XLM-R differ only in their position ids.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import numpy as np

# model_type -> how position ids are counted
_POSITIONS = {"bert": "absolute", "roberta": "padding_offset", "xlm-roberta": "padding_offset",
              "camembert": "padding_offset"}
_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish")
_PREFIXES = ("bert.", "roberta.", "model.")  # a task model's base-model prefix in its weight names


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """The shapes and constants of a BERT-family encoder (frozen, hashable: a static jit argument)."""
  vocab_size: int
  hidden_size: int  # h
  num_hidden_layers: int
  num_attention_heads: int  # H
  intermediate_size: int
  max_position_embeddings: int
  type_vocab_size: int
  layer_norm_eps: float
  hidden_act: str
  positions: str  # "absolute" (BERT) or "padding_offset" (RoBERTa, XLM-R)
  pad_token_id: int


def check_config(raw: dict, where: str = "checkpoint") -> BertConfig:
  """A `BertConfig` from a checkpoint's `config.json` contents.

  Raises:
    ValueError: naming `where` and what is not supported.
  """
  model_type = raw.get("model_type")
  if model_type not in _POSITIONS:
    raise ValueError(
        f"{where}: model_type {model_type!r} (architectures {raw.get('architectures')}) is not "
        f"supported; the encoder runs BERT-family checkpoints ({', '.join(sorted(_POSITIONS))}). "
        "For another model, precompute the embeddings and pass a .npz file")
  act = raw.get("hidden_act", "gelu")
  if act not in _ACTIVATIONS:
    raise ValueError(f"{where}: hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
  if raw.get("position_embedding_type", "absolute") != "absolute":
    raise ValueError(f"{where}: position_embedding_type {raw['position_embedding_type']!r} is not "
                     "supported (only 'absolute')")
  if raw.get("is_decoder") or raw.get("add_cross_attention"):
    raise ValueError(f"{where}: a decoder / cross-attention model is not a text encoder")
  if raw["hidden_size"] % raw["num_attention_heads"]:
    raise ValueError(f"{where}: hidden_size {raw['hidden_size']} is not a multiple of "
                     f"num_attention_heads {raw['num_attention_heads']}")
  return BertConfig(
      vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
      num_hidden_layers=int(raw["num_hidden_layers"]),
      num_attention_heads=int(raw["num_attention_heads"]),
      intermediate_size=int(raw["intermediate_size"]),
      max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
      type_vocab_size=int(raw.get("type_vocab_size", 2)),
      layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)), hidden_act=act,
      positions=_POSITIONS[model_type], pad_token_id=int(raw.get("pad_token_id") or 0))


def _modules(config: BertConfig):
  """The Flax module of `config` (built here so that importing this module needs no Flax)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  act = {"gelu": lambda x: nn.gelu(x, approximate=False), "gelu_new": nn.gelu,
         "gelu_pytorch_tanh": nn.gelu, "relu": nn.relu, "silu": nn.silu,
         "swish": nn.silu}[config.hidden_act]
  eps = config.layer_norm_eps
  heads, h = config.num_attention_heads, config.hidden_size

  class SelfAttention(nn.Module):
    @nn.compact
    def __call__(self, x, bias):  # x: [B, L, h]; bias: [B, 1, 1, L]
      split = lambda t: t.reshape(t.shape[:2] + (heads, h // heads))
      q, k, v = (split(nn.Dense(h, name=n)(x)) for n in ("query", "key", "value"))
      weights = nn.dot_product_attention_weights(q, k, bias=bias, deterministic=True)  # [B, H, L, L]
      out = jnp.einsum("...hqk,...khd->...qhd", weights, v)
      return out.reshape(out.shape[:2] + (h,))

  class Dense(nn.Module):  # the `dense` + residual `LayerNorm` pair of BERT's sublayers
    features: int

    @nn.compact
    def __call__(self, x, residual):
      return nn.LayerNorm(epsilon=eps, name="LayerNorm")(nn.Dense(self.features, name="dense")(x)
                                                         + residual)

  class Attention(nn.Module):
    @nn.compact
    def __call__(self, x, bias):
      return Dense(h, name="output")(SelfAttention(name="self")(x, bias), x)

  class Intermediate(nn.Module):
    @nn.compact
    def __call__(self, x):
      return act(nn.Dense(config.intermediate_size, name="dense")(x))

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, bias):
      a = Attention(name="attention")(x, bias)
      return Dense(h, name="output")(Intermediate(name="intermediate")(a), a)

  class Layers(nn.Module):
    @nn.compact
    def __call__(self, x, bias):
      for i in range(config.num_hidden_layers):
        x = Layer(name=str(i))(x, bias)
      return x

  class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x, bias):
      return Layers(name="layer")(x, bias)

  class Embeddings(nn.Module):
    @nn.compact
    def __call__(self, input_ids, position_ids):
      x = (nn.Embed(config.vocab_size, h, name="word_embeddings")(input_ids)
           + nn.Embed(config.type_vocab_size, h, name="token_type_embeddings")(
               jnp.zeros_like(input_ids))
           + nn.Embed(config.max_position_embeddings, h, name="position_embeddings")(position_ids))
      return nn.LayerNorm(epsilon=eps, name="LayerNorm")(x)

  class Bert(nn.Module):
    """`[B, L]` int32 token ids and attention mask -> `[B, L, h]` last hidden states."""

    @nn.compact
    def __call__(self, input_ids, attention_mask):
      if config.positions == "absolute":
        position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
      else:  # RoBERTa: real tokens count from pad_token_id + 1, padding sits at pad_token_id
        real = (input_ids != config.pad_token_id).astype(jnp.int32)
        position_ids = jnp.cumsum(real, axis=1) * real + config.pad_token_id
      bias = jnp.where(attention_mask[:, None, None, :] > 0, jnp.float32(0),
                       jnp.finfo(jnp.float32).min)
      x = Embeddings(name="embeddings")(input_ids, position_ids)
      return Encoder(name="encoder")(x, bias)

  return Bert()


def hidden_states(params: Any, input_ids, attention_mask, config: BertConfig):
  """The last hidden layer of the encoder, `[B, L, h]` float32.

  Args:
    params: the parameter tree of `load`.
    input_ids: `[B, L]` int32 token ids.
    attention_mask: `[B, L]` int32, 1 = a real token, 0 = padding (never attended to).
    config: the encoder's `BertConfig` (static under jit).
  """
  return _modules(config).apply({"params": params}, input_ids, attention_mask)


def from_torch_names(weights: dict[str, np.ndarray]) -> dict:
  """A PyTorch state dict (`embeddings.word_embeddings.weight`, ...) as the Flax parameter tree."""
  tree: dict = {}
  for name, value in weights.items():
    name = next((name[len(p):] for p in _PREFIXES if name.startswith(p)), name)
    parts = name.split(".")
    if parts[0] not in ("embeddings", "encoder") or parts[-1] not in ("weight", "bias", "gamma",
                                                                      "beta"):
      continue  # the pooler, a task head, position_ids buffers
    leaf, parent = parts[-1], parts[-2]
    if parent.endswith("_embeddings"):
      leaf = "embedding"
    elif parent == "LayerNorm":
      leaf = {"weight": "scale", "gamma": "scale", "beta": "bias"}.get(leaf, leaf)
    elif leaf == "weight":
      leaf, value = "kernel", np.asarray(value).T
    node = tree
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[leaf] = np.asarray(value, np.float32)
  return tree


def _read_weights(model_dir: pathlib.Path) -> dict:
  """The encoder's parameter tree from the checkpoint's weight files (see the module doc)."""
  shards = sorted(model_dir.glob("model-*.safetensors"))
  if (model_dir / "model.safetensors").is_file() or shards:
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
    weights = {}
    for f in ([model_dir / "model.safetensors"] if not shards else shards):
      weights.update(load_file(str(f)))
    return from_torch_names(weights)
  if (model_dir / "flax_model.msgpack").is_file():
    from flax import serialization  # pylint: disable=g-import-not-at-top
    tree = serialization.msgpack_restore((model_dir / "flax_model.msgpack").read_bytes())
    for key in ("bert", "roberta", "model"):
      if set(tree) == {key} or (key in tree and "embeddings" not in tree):
        tree = tree[key]
    return {k: tree[k] for k in ("embeddings", "encoder")}
  if (model_dir / "pytorch_model.bin").is_file():
    try:
      import torch  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ValueError(f"encoder directory {str(model_dir)!r} has only PyTorch weights "
                       "(pytorch_model.bin) and torch is not installed: install torch, or save "
                       "the checkpoint as model.safetensors") from None
    state = torch.load(str(model_dir / "pytorch_model.bin"), map_location="cpu",
                       weights_only=True)
    return from_torch_names({k: v.float().numpy() for k, v in state.items()})
  raise ValueError(f"encoder directory {str(model_dir)!r} has no weights this encoder reads "
                   "(model.safetensors, model-*.safetensors, flax_model.msgpack or "
                   "pytorch_model.bin; sharded Flax / PyTorch checkpoints: save them as "
                   "safetensors)")


def _leaf_shapes(tree) -> dict:
  """`{"a/b/c": shape}` for each leaf of `tree`, keyed by its path."""
  import jax  # pylint: disable=g-import-not-at-top
  return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(np.shape(leaf))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_shapes(params: dict, config: BertConfig, where: str) -> None:
  """ValueError naming the first parameter the checkpoint lacks or has in another shape."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  ids = jnp.zeros((1, 2), jnp.int32)
  want = jax.eval_shape(lambda: _modules(config).init(jax.random.PRNGKey(0), ids, ids))["params"]
  got = _leaf_shapes(params)
  for name, shape in _leaf_shapes(want).items():
    if name not in got:
      raise ValueError(f"{where}: the weights have no {name!r} (not a BERT-family encoder?)")
    if got[name] != shape:
      raise ValueError(f"{where}: weight {name!r} has shape {got[name]}, the config needs {shape}")


def load(model_dir, config: BertConfig) -> dict:
  """The parameter tree (device arrays) of a checkpoint directory of `config` (`check_config`).

  Raises:
    ValueError: naming the directory, for missing weight files or weights that do not fit `config`.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  model_dir = pathlib.Path(model_dir)
  params = _read_weights(model_dir)
  _check_shapes(params, config, f"encoder directory {str(model_dir)!r}")
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
