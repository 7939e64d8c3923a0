"""Hostile input: every error names the file (the line for JSONL) and the field."""
import json
import types

import numpy as np
import pytest
from absl import app

from ear_jax.data import candidates
from ear_jax.data import corpora
from ear_jax.data import encoders
from experiments import data_flags

_MEMORY = {"type": "memory", "id": "m1", "text": "I adopted a cat named Luna."}
_QUERY = {"type": "query", "id": "q1", "text": "What is my cat called?", "gold": ["m1"]}


def _jsonl(tmp_path, *objs, name="bank.jsonl"):
  p = tmp_path / name
  p.write_text("\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs) + "\n")
  return p


class _NeverEncoder(encoders.Encoder):
  """An encoder that fails the test if anything reaches the model."""
  name, dim = "never", 4

  @property
  def identity(self):
    return {"kind": "never"}

  def encode_new(self, texts, progress=True, bar=None):
    raise AssertionError(f"encoded {len(texts)} texts")


class _CountingEncoder(_NeverEncoder):
  name = "counting"

  def encode_new(self, texts, progress=True, bar=None):
    return np.ones((len(texts), self.dim), np.float32) / 2, 0


# ---------------------------------------------------------------- JSONL

@pytest.mark.parametrize("kind, field", [("memory", "text"), ("memory", "id"), ("query", "text")])
def test_jsonl_null_text_or_id_is_an_error_not_the_string_none(tmp_path, kind, field):
  obj = dict(_MEMORY if kind == "memory" else _QUERY, **{field: None})
  lines = [obj, _QUERY] if kind == "memory" else [_MEMORY, obj]
  p = _jsonl(tmp_path, *lines)
  line = 1 if kind == "memory" else 2
  with pytest.raises(ValueError, match=rf"bank\.jsonl: line {line}: field '{field}' must be .*null"):
    corpora.load_jsonl(p)


@pytest.mark.parametrize("kind", ["memory", "query"])
def test_jsonl_empty_text_is_rejected(tmp_path, kind):
  lines = [dict(_MEMORY, text=""), _QUERY] if kind == "memory" else [_MEMORY, dict(_QUERY, text="")]
  with pytest.raises(ValueError, match=r"bank\.jsonl: line \d: field 'text' must be a non-empty"):
    corpora.load_jsonl(_jsonl(tmp_path, *lines))


@pytest.mark.parametrize("obj, field", [
    (dict(_QUERY, gold=["m1", None]), "gold"),
    (dict(_QUERY, bank=None), "bank"),
    (dict(_QUERY, category=["a"]), "category"),
    (dict(_QUERY, text=42), "text"),
])
def test_jsonl_wrong_types_name_line_and_field(tmp_path, obj, field):
  with pytest.raises(ValueError, match=rf"bank\.jsonl: line 2: field '{field}'"):
    corpora.load_jsonl(_jsonl(tmp_path, _MEMORY, obj))


def test_jsonl_non_utf8_names_file_and_line(tmp_path):
  p = tmp_path / "latin1.jsonl"
  p.write_bytes(json.dumps(_MEMORY).encode() + b"\n"
                + json.dumps(dict(_QUERY, text="caf\u00e9")).encode("ascii").replace(
                    b"\\u00e9", "\u00e9".encode("latin-1")) + b"\n")
  with pytest.raises(ValueError, match=r"latin1\.jsonl: line 2: not valid UTF-8"):
    corpora.load_jsonl(p)


def test_jsonl_without_queries_fails_before_any_encoding(tmp_path):
  p = _jsonl(tmp_path, _MEMORY, dict(_MEMORY, id="m2"))
  with pytest.raises(ValueError, match=r"bank\.jsonl: no query lines"):
    candidates.load_benchmark(f"jsonl:{p}", encoder=_NeverEncoder(), cache_dir=tmp_path / "c",
                              progress=False)
  assert not (tmp_path / "c").exists()


def test_jsonl_without_an_evaluable_query_fails_before_any_encoding(tmp_path):
  p = _jsonl(tmp_path, _MEMORY, dict(_QUERY, gold=["nope"]), dict(_QUERY, id="q2", gold=[]))
  with pytest.raises(ValueError, match=r"bank\.jsonl: none of its 2 queries is evaluable"):
    candidates.load_benchmark(str(p), encoder=_NeverEncoder(), progress=False)


def test_jsonl_directory_says_it_is_a_directory(tmp_path):
  d = tmp_path / "bank.jsonl"
  d.mkdir()
  for load in (lambda: corpora.load_jsonl(d), lambda: corpora.load_corpus(f"jsonl:{d}"),
               lambda: corpora.load_corpus(str(d))):
    with pytest.raises(IsADirectoryError, match=r"bank\.jsonl.*is a directory"):
      load()


def test_jsonl_flag_naming_a_directory_is_a_usage_error_saying_so(tmp_path):
  flags = types.SimpleNamespace(benchmark=types.SimpleNamespace(value="jsonl"),
                                jsonl=types.SimpleNamespace(value=str(tmp_path)))
  with pytest.raises(app.UsageError, match=r"--jsonl=.* is a directory"):
    data_flags.benchmark_name(flags)
  flags.jsonl.value = str(tmp_path / "missing.jsonl")
  with pytest.raises(app.UsageError, match=r"--jsonl=.*missing\.jsonl.* does not exist"):
    data_flags.benchmark_name(flags)
  flags.jsonl.value = str(_jsonl(tmp_path, _MEMORY, _QUERY))
  assert data_flags.benchmark_name(flags) == f"jsonl:{flags.jsonl.value}"


def test_jsonl_utf8_bom_and_crlf_are_accepted(tmp_path):
  p = tmp_path / "bom.jsonl"
  p.write_bytes(b"\xef\xbb\xbf" + json.dumps(_MEMORY).encode() + b"\r\n" + json.dumps(_QUERY).encode()
                + b"\r\n")
  c = corpora.load_jsonl(p)
  assert c.banks[0].texts == [_MEMORY["text"]] and c.queries[0].gold == ("m1",)


# ---------------------------------------------------------------- LoCoMo

def _locomo():
  return [{
      "sample_id": "conv-x",
      "conversation": {"speaker_a": "Ann", "speaker_b": "Bo",
                       "session_1": [{"speaker": "Ann", "dia_id": "D1:1", "text": "I got a puppy."}]},
      "observation": {"session_1_observation": {"Ann": [["Ann has a puppy.", "D1:1"]]}},
      "qa": [{"question": "What pet?", "answer": "a puppy", "evidence": ["D1:1"], "category": 4}],
  }]


def _set(data, path, value):
  obj = data[0]
  for k in path[:-1]:
    obj = obj[k]
  obj[path[-1]] = value
  return data


@pytest.mark.parametrize("path, value, field", [
    (("observation",), ["Ann has a puppy."], "observation"),
    (("conversation",), None, "conversation"),
    (("qa",), {"question": "x"}, "qa"),
    (("conversation", "session_1"), None, "conversation.session_1"),
    (("conversation", "session_1", 0, "text"), None, "text"),
    (("conversation", "session_1", 0, "speaker"), 7, "speaker"),
    (("observation", "session_1_observation"), ["x"], "observation.session_1_observation"),
    (("observation", "session_1_observation", "Ann"), "Ann has a puppy.",
     "observation.session_1_observation.Ann"),
    (("observation", "session_1_observation", "Ann", 0, 0), None, "fact"),
    (("qa", 0, "question"), None, "question"),
    (("qa", 0, "evidence"), {"D1": 1}, "evidence"),
    (("sample_id",), None, "sample_id"),
])
def test_locomo_wrong_types_name_file_sample_and_field(tmp_path, path, value, field):
  p = tmp_path / "locomo10.json"
  p.write_text(json.dumps(_set(_locomo(), path, value)))
  with pytest.raises(ValueError, match=rf"locomo10\.json: conversation .*field '{field}' must be"):
    corpora.load_locomo(p)
  if field != "sample_id":
    with pytest.raises(ValueError, match=r"conversation 'conv-x'"):
      corpora.load_locomo(p)


def test_longmemeval_wrong_types_name_the_question_and_field(tmp_path):
  item = {"question_id": "q1", "question_type": "single-session-user", "question": "Where?",
          "haystack_session_ids": ["s1"],
          "haystack_sessions": [[{"role": "user", "content": None, "has_answer": True}]]}
  p = tmp_path / "longmemeval_s.json"
  p.write_text(json.dumps([item]))
  with pytest.raises(ValueError, match=r"question 'q1', session 's1' turn 0: field 'content'"):
    corpora.load_longmemeval(p)
  item["haystack_sessions"] = {"s1": []}
  p.write_text(json.dumps([item]))
  with pytest.raises(ValueError, match=r"question 'q1': field 'haystack_sessions' must be a list"):
    corpora.load_longmemeval(p)


# ---------------------------------------------------------------- encoder

def test_encoder_from_a_missing_path_names_it():
  with pytest.raises(FileNotFoundError, match=r"'/nonexistent' does not exist"):
    encoders.load_encoder("/nonexistent")
  with pytest.raises(ValueError, match=r"/nonexistent/model\.npz' does not exist"):
    encoders.load_encoder("/nonexistent/model.npz")


def test_check_encoder_spec_is_cheap_and_names_the_missing_path(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"'/nonexistent' does not exist"):
    encoders.check_encoder_spec("/nonexistent")
  assert encoders.check_encoder_spec("minilm") == "minilm"
  assert encoders.check_encoder_spec(tmp_path) == tmp_path


@pytest.mark.parametrize("texts, pattern", [
    (["ok", "a\ud800b"], r"text 1 'a\\ud800b' is not valid Unicode.*surrogate"),
    (["ok", "fine", None], r"text 2 is NoneType .*not a string"),
])
def test_encode_names_the_bad_text(tmp_path, texts, pattern):
  with pytest.raises(ValueError, match=pattern):
    encoders.encode(_NeverEncoder(), texts, cache_dir=tmp_path, progress=False)


def test_encode_still_encodes_valid_unicode(tmp_path):
  emb = encoders.encode(_CountingEncoder(), ["caf\u00e9", "\U0001f600", ""], cache_dir=tmp_path,
                        progress=False)
  assert emb.shape == (3, 4)


# --------------------------------------------------------------------------- precomputed embeddings

_TEXTS = ["alpha", "beta", "gamma"]


def _unit_rows(x):
  x = np.asarray(x, np.float64)
  return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("kind", ["npz", "npy"])
def test_precomputed_rows_of_any_magnitude_are_normalised_never_zeroed(tmp_path, kind):
  v = np.random.default_rng(0).normal(size=(3, 6))
  emb = v * np.array([[1e20], [1e-25], [1e300]])  # float32 squares overflow / underflow; > float32
  if kind == "npz":
    path = tmp_path / "e.npz"
    np.savez(path, embeddings=emb, texts=np.asarray(_TEXTS))
  else:
    path = tmp_path / "e.npy"
    np.save(path, emb)
    (tmp_path / "e.texts.json").write_text(json.dumps(_TEXTS))
  got = encoders.encode(encoders.load_encoder(str(path)), _TEXTS, progress=False)
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, _unit_rows(v), atol=1e-6)


def _bad_file(tmp_path, emb, kind):
  path = tmp_path / f"bad.{kind}"
  if kind == "npz":
    np.savez(path, embeddings=emb, texts=np.asarray(_TEXTS[:len(emb)]))
  else:
    np.save(path, emb, allow_pickle=True)
    (tmp_path / "bad.texts.json").write_text(json.dumps(_TEXTS[:len(emb)]))
  return path


@pytest.mark.parametrize("kind", ["npz", "npy"])
@pytest.mark.parametrize("emb, problem", [
    (np.ones((2, 4)) * (1 + 2j), r"dtype complex128: complex numbers"),
    (np.ones((2, 4), bool), r"dtype bool: booleans"),
    (np.full((2, 4), "0.5"), r"dtype <U3: strings"),
    (np.full((2, 4), 0.5, dtype=object), r"object|allow_pickle"),
    (np.array([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]), r"all-zero row\(s\) \[1\]"),
    (np.array([[1.0, 2.0, 3.0, 4.0], [0.0, np.nan, 0.0, 1.0]]), r"NaN or Inf\) in row\(s\) \[1\]"),
], ids=["complex", "bool", "str", "object", "zero_row", "nan"])
def test_precomputed_non_real_or_unusable_rows_are_refused_naming_the_file(tmp_path, emb, problem,
                                                                            kind):
  path = _bad_file(tmp_path, emb, kind)
  with pytest.raises(ValueError, match=problem) as info:
    encoders.load_encoder(str(path))
  assert str(path) in str(info.value)


def test_precomputed_unreadable_file_is_an_error_naming_it(tmp_path):
  path = tmp_path / "broken.npz"
  path.write_bytes(b"PK\x03\x04 not really a zip")
  with pytest.raises(ValueError, match="broken.npz: not a readable .npz file"):
    encoders.load_encoder(str(path))


def test_jsonl_bank_with_huge_precomputed_embeddings_gives_unit_rows(tmp_path):
  """The JSONL format carries texts only; its embeddings come from the encoder, here a `.npz` of
  rows whose float32 norms overflow."""
  path = _jsonl(tmp_path, _MEMORY, {**_MEMORY, "id": "m2", "text": "My sister lives in Lisbon."},
                _QUERY)
  texts = [_MEMORY["text"], "My sister lives in Lisbon.", _QUERY["text"]]
  v = np.random.default_rng(1).normal(size=(3, 6))
  np.savez(tmp_path / "huge.npz", embeddings=v * 1e25, texts=np.asarray(texts))
  ec, _ = candidates.embed_corpus(corpora.load_jsonl(path), str(tmp_path / "huge.npz"),
                                  progress=False)
  np.testing.assert_allclose(ec.bank_embeddings[0], _unit_rows(v[:2]), atol=1e-6)
  np.testing.assert_allclose(ec.query_embeddings, _unit_rows(v[2:]), atol=1e-6)


def test_a_missing_benchmark_file_is_a_usage_error_saying_where_to_put_it(tmp_path, monkeypatch):
  """Every program that takes the data flags refuses a missing file up front."""
  monkeypatch.delenv("EAR_DATA_DIR", raising=False)
  flags = types.SimpleNamespace(benchmark=types.SimpleNamespace(value="locomo"),
                                data_dir=types.SimpleNamespace(value=str(tmp_path / "nowhere")))
  with pytest.raises(app.UsageError, match=r"(?s)--benchmark=locomo.*locomo10\.json"):
    data_flags.benchmark_name(flags)


def test_a_usage_error_prints_its_message_without_the_flag_help(capsys):
  """`cli.run` turns absl's help dump (module docstring + every flag) into one message on stderr
  and the error's exit code."""
  from experiments import cli

  def main(argv):
    del argv
    raise app.UsageError("--data_dir: no locomo10.json there")

  assert cli.without_usage_dump(main)(["prog"]) == 1
  out, err = capsys.readouterr()
  assert out == ""
  assert "error: --data_dir: no locomo10.json there" in err
  assert len(err.splitlines()) == 2 and "flags:" not in err and "--helpshort" in err


@pytest.mark.slow
def test_the_run_command_with_a_missing_data_file_prints_a_short_error(tmp_path):
  """End to end: no flag help, no traceback, exit code 1, nothing written."""
  import os
  import pathlib
  import subprocess
  import sys
  repo = pathlib.Path(__file__).resolve().parents[1]
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.run", "--benchmark=locomo",
       f"--data_dir={tmp_path / 'nowhere'}", f"--workdir={tmp_path / 'wd'}"],
      cwd=repo, capture_output=True, text=True, timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 1, proc.stderr[-2000:]
  text = proc.stdout + proc.stderr
  assert "locomo10.json" in text and "experiments.download" in text
  assert "Traceback" not in text and "--checkpoint_every" not in text, text[-3000:]
  ours = [l for l in text.splitlines() if "nowhere" in l or "experiments" in l or "error" in l]
  assert len(ours) <= 6, text
  assert not (tmp_path / "wd").exists()
