"""Encoder test inputs: tiny random BERT-family checkpoints written from a seed, a LoCoMo slice.

`write_tiny_checkpoint(directory, model_type)` writes `config.json`, `model.safetensors` (PyTorch
weight names, as the Hub's checkpoints have them) and a WordPiece tokenizer: `vocab.txt` only for
BERT (the tokenizer is built from it), `tokenizer.json` for RoBERTa. The same seed always writes the
same bytes, so `tests/fixtures/tiny_encoders.json` (embeddings computed from these checkpoints by
transformers' `FlaxAutoModel`, `tests/fixtures/make_tiny_encoders.py`) stays valid.
"""
import json
import pathlib

import numpy as np

from ear_jax.data import candidates
from ear_jax.data import corpora

WORDS = ("the cat sat on mat a dog barked at moon caroline went to support group yesterday "
         "melanie painted sunrise over lake last year why does it matter her and of in is was "
         "what did how when where who new old big small red blue green run walk talk ##s ##ed "
         "##ing un ##able").split()
TEXTS = ["the cat sat on the mat", "Caroline went to the support group yesterday",
         "what did Melanie paint last year and why does the sunrise over the lake matter",
         "a dog barked", "unable xyz"]
HIDDEN, LAYERS, HEADS, INTERMEDIATE, POSITIONS = 32, 2, 4, 64, 40


def _config(model_type: str, vocab_size: int) -> dict:
  roberta = model_type == "roberta"
  return {"architectures": ["RobertaModel" if roberta else "BertModel"], "model_type": model_type,
          "vocab_size": vocab_size, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
          "num_attention_heads": HEADS, "intermediate_size": INTERMEDIATE,
          "hidden_act": "gelu", "max_position_embeddings": POSITIONS + (2 if roberta else 0),
          "type_vocab_size": 1 if roberta else 2, "layer_norm_eps": 1e-12 if not roberta
          else 1e-5, "pad_token_id": 1 if roberta else 0, "initializer_range": 0.5}


def _weights(cfg: dict, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  normal = lambda *shape: (0.5 * rng.standard_normal(shape)).astype(np.float32)
  h, f = cfg["hidden_size"], cfg["intermediate_size"]
  base = "roberta." if cfg["model_type"] == "roberta" else ""  # a task model's prefix
  w = {f"{base}embeddings.word_embeddings.weight": normal(cfg["vocab_size"], h),
       f"{base}embeddings.position_embeddings.weight": normal(cfg["max_position_embeddings"], h),
       f"{base}embeddings.token_type_embeddings.weight": normal(cfg["type_vocab_size"], h),
       f"{base}embeddings.LayerNorm.weight": 1 + normal(h) / 5,
       f"{base}embeddings.LayerNorm.bias": normal(h) / 5}
  for i in range(cfg["num_hidden_layers"]):
    p = f"{base}encoder.layer.{i}."
    for name, (o, n) in {"attention.self.query": (h, h), "attention.self.key": (h, h),
                         "attention.self.value": (h, h), "attention.output.dense": (h, h),
                         "intermediate.dense": (f, h), "output.dense": (h, f)}.items():
      w[p + name + ".weight"] = normal(o, n) / np.sqrt(n)
      w[p + name + ".bias"] = normal(o) / 5
    for name in ("attention.output.LayerNorm", "output.LayerNorm"):
      w[p + name + ".weight"] = 1 + normal(h) / 5
      w[p + name + ".bias"] = normal(h) / 5
  w[f"{base}pooler.dense.weight"] = normal(h, h)  # not part of the encoder's output
  w[f"{base}pooler.dense.bias"] = normal(h)
  return w


def write_tiny_checkpoint(directory, model_type: str, seed: int = 0) -> pathlib.Path:
  """Writes a tiny random `model_type` ('bert' or 'roberta') checkpoint into `directory`."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  if model_type == "bert":
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(WORDS)
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 512}))
  else:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors  # pylint: disable=g-import-not-at-top
    vocab = ["<s>", "<pad>", "</s>", "<unk>"] + list(WORDS)
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", "pad_token": "<pad>", "cls_token": "<s>", "sep_token": "</s>",
         "model_max_length": POSITIONS}))
  cfg = _config(model_type, len(vocab))
  (directory / "config.json").write_text(json.dumps(cfg, indent=1))
  save_file(_weights(cfg, seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
  return directory


def locomo_texts(data_dir=None) -> list[str]:
  """The distinct texts the LoCoMo benchmark encodes, in its order (queries, then dialogue)."""
  texts, _, _ = candidates.encoded_texts(corpora.load_corpus("locomo", data_dir=data_dir))
  return list(dict.fromkeys(texts))


def locomo_slice(texts: list[str]) -> list[str]:
  """20 texts evenly spaced over `texts` and the 4 longest (tests/fixtures/locomo_minilm_slice.npz)."""
  spaced = [texts[i] for i in np.linspace(0, len(texts) - 1, 20).astype(int)]
  longest = sorted(texts, key=len)[-4:]
  return list(dict.fromkeys(spaced + longest))
