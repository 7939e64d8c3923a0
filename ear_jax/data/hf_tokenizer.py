"""A Hugging Face checkpoint's tokenizer, run with the `tokenizers` library (no transformers).

Symbols: `n` texts, `L` padded token length.

Reads `tokenizer.json` (or a BERT `vocab.txt`) and the settings of `tokenizer_config.json` /
`special_tokens_map.json` that change the ids. Stored truncation and padding are replaced: texts
are truncated at the encoder's maximum length (special tokens kept) and padded by `pad`. Encoding
never changes the tokenizer's state, so threads can share it.
"""
from __future__ import annotations

import json
import pathlib
from typing import Sequence

import numpy as np

_VERY_LARGE = 1_000_000  # a model_max_length at or above this means "no limit" (transformers' 1e30)


def _read_json(path: pathlib.Path) -> dict:
  return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token) -> str | None:
  """A special token as written in tokenizer_config.json: a string or `{"content": ...}`."""
  return token.get("content") if isinstance(token, dict) else token


class CheckpointTokenizer:
  """The tokenizer of a checkpoint directory, truncating at `max_length` tokens.

  Attributes:
    vocab_size: tokens including the added ones (`len(tokenizer)` in transformers).
    pad_id: the id of padded positions (the padding token, else the separator / end token, else 0).
    model_max_length: the tokenizer's own limit from `tokenizer_config.json` (None: no limit).

  Raises:
    ValueError: naming the directory, when it has no tokenizer the `tokenizers` library can load.
  """

  def __init__(self, model_dir):
    import tokenizers  # pylint: disable=g-import-not-at-top
    model_dir = pathlib.Path(model_dir)
    cfg = _read_json(model_dir / "tokenizer_config.json")
    special = {**_read_json(model_dir / "special_tokens_map.json"), **cfg}
    bert = str(cfg.get("tokenizer_class", "")).startswith("Bert")
    lower = cfg.get("do_lower_case", True)
    accents = cfg.get("strip_accents")
    chinese = cfg.get("tokenize_chinese_chars", True)
    where = f"encoder directory {str(model_dir)!r}"
    if (model_dir / "tokenizer.json").is_file():
      try:
        tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
      except Exception as e:  # pylint: disable=broad-except
        raise ValueError(f"{where}: cannot load tokenizer.json: {e}") from None
      state = json.loads(tok.normalizer.__getstate__()) if bert and tok.normalizer else {}
      if state.get("type") == "BertNormalizer" and (
          state.get("lowercase", lower), state.get("strip_accents", accents),
          state.get("handle_chinese_chars", chinese)) != (lower, accents, chinese):
        # As transformers' BertTokenizerFast: tokenizer_config.json's settings win.
        tok.normalizer = tokenizers.normalizers.BertNormalizer(
            clean_text=state.get("clean_text", True), handle_chinese_chars=chinese,
            strip_accents=accents, lowercase=lower)
    elif (model_dir / "vocab.txt").is_file():
      from tokenizers.implementations import BertWordPieceTokenizer  # pylint: disable=g-import-not-at-top
      tokens = {f"{n}_token": _token_text(special.get(f"{n}_token")) or f"[{n.upper()}]"
                for n in ("unk", "sep", "cls", "pad", "mask")}
      tok = BertWordPieceTokenizer(
          tokenizers.models.WordPiece.read_file(str(model_dir / "vocab.txt")), **tokens,
          clean_text=True, handle_chinese_chars=chinese, strip_accents=accents, lowercase=lower)
    else:
      raise ValueError(f"{where}: no tokenizer (tokenizer.json, or vocab.txt for a BERT "
                       "WordPiece vocabulary)")
    tok.no_padding()
    tok.no_truncation()
    self._tok = tok
    self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
    pad_id = None
    for name in ("pad_token", "sep_token", "eos_token"):
      text = _token_text(special.get(name))
      if text is not None and tok.token_to_id(text) is not None:
        pad_id = tok.token_to_id(text)
        break
    self.pad_id = int(pad_id or 0)
    limit = cfg.get("model_max_length")
    self.model_max_length = int(limit) if limit and limit < _VERY_LARGE else None

  def truncate_at(self, max_length: int) -> None:
    """Sets the token limit every later `encode` truncates at (special tokens included)."""
    self._tok.enable_truncation(int(max_length))

  def encode(self, texts: Sequence[str]) -> tuple[list[list[int]], np.ndarray]:
    """Token ids of `texts` (special tokens added, truncated) and `[n]` bool: truncated."""
    encs = self._tok.encode_batch(list(texts), add_special_tokens=True)
    return [e.ids for e in encs], np.asarray([bool(e.overflowing) for e in encs], bool)

  def pad(self, ids: Sequence[Sequence[int]], length: int, rows: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """`[rows, length]` int32 ids (right-padded with `pad_id`) and attention mask."""
    input_ids = np.full((rows, length), self.pad_id, np.int32)
    mask = np.zeros((rows, length), np.int32)
    for i, row in enumerate(ids):
      row = row[:length]
      input_ids[i, :len(row)] = row
      mask[i, :len(row)] = 1
    return input_ids, mask
