"""Tests for ear_jax/data/corpora.py and its loaders (locomo, longmemeval, jsonl): evidence ids, splits."""
import gzip
import json
import pathlib

import numpy as np
import pytest

from ear_jax.data import corpora as datasets
from ear_jax.data import corpus as corpus_lib
from ear_jax.data import sources

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
LME_TINY = FIXTURES / "longmemeval_tiny.json"


# ---------------------------------------------------------------- evidence normalisation

@pytest.mark.parametrize("raw, ids, bad", [
    ("D1:3", ["D1:3"], []),
    ("D8:6; D9:17", ["D8:6", "D9:17"], []),  # semicolon-joined
    ("D:11:26", ["D11:26"], []),  # extra colon
    ("D30:05", ["D30:5"], []),  # zero-padded turn
    ("D9:1 D4:4 D4:6", ["D9:1", "D4:4", "D4:6"], []),  # space-joined
    ("D21:18 D21:22 D11:15 D11:19", ["D21:18", "D21:22", "D11:15", "D11:19"], []),
    ("D", [], ["D"]),  # unparseable
    (["D15:3", "D15:5"], ["D15:3", "D15:5"], []),  # observation refs as a list
    ("D26:14, D26:34, D26:42", ["D26:14", "D26:34", "D26:42"], []),  # comma-joined string
    (["D1:18", "D", "D1:20"], ["D1:18", "D1:20"], ["D"]),
    ("D2:7;D2:7", ["D2:7"], []),  # repeats collapse
])
def test_normalize_evidence_on_each_quirk(raw, ids, bad):
  assert datasets.normalize_evidence(raw) == (ids, bad)


# ---------------------------------------------------------------- LoCoMo, real file

@pytest.fixture(scope="module")
def locomo(locomo_path):
  return datasets.load_locomo(locomo_path)


def test_locomo_reproduces_table_1(locomo):
  s = locomo.stats
  assert (s["conversations"], s["sessions"], s["turns"], s["queries"]) == (10, 272, 5882, 1540)
  assert sum(len(b) - int(b.stores.sum()) for b in locomo.banks) == 5882


def test_locomo_drops_adversarial_empty_evidence_and_unresolvable_ids(locomo):
  s = locomo.stats
  assert s["queries_adversarial_dropped"] == 446
  assert s["queries_empty_evidence_dropped"] == 4
  assert s["queries_without_gold_excluded"] == 0
  assert s["queries_evaluable"] == len(locomo.queries) == 1536
  # "D" and the two ids past the end of their session.
  assert sorted(s["evidence_ids_dropped_list"]) == ["conv-42/D", "conv-42/D10:19", "conv-47/D4:36"]
  assert s["evidence_entries_malformed"] == 7
  assert s["queries_per_category"] == {"multi-hop": 282, "open-domain": 92, "single-hop": 841,
                                       "temporal": 321}
  assert s["observations"] == 2541 and s["observation_refs_unresolvable"] == 0


def test_locomo_quirky_evidence_is_resolved(locomo):
  by_gold = {(q.id.split("/")[0], q.gold) for q in locomo.queries}
  assert ("conv-26", ("D8:6", "D9:17")) in by_gold
  assert ("conv-50", ("D30:5",)) in by_gold
  assert ("conv-49", ("D9:1", "D4:4", "D4:6")) in by_gold
  assert any(c == "conv-43" and "D11:26" in g for c, g in by_gold)
  assert any(c == "conv-42" and g == ("D1:18", "D1:20") for c, g in by_gold)
  for q in locomo.queries:  # every gold id names a dialogue turn of its own conversation
    assert set(q.gold) <= set(locomo.banks[q.group].ids)


def test_locomo_turn_text_has_speaker_and_image_caption(locomo):
  b = locomo.banks[0]
  i = b.ids.index("D1:1")
  assert b.texts[i] == "Caroline: Hey Mel! Good to see you! How have you been?"
  i = b.ids.index("D1:5")
  assert b.texts[i].startswith("Caroline: The transgender stories were so inspiring!")
  assert b.texts[i].endswith("[image: a photo of a dog walking past a wall with a painting of a woman]")


def test_locomo_observation_gold_is_derived_from_referenced_dia_ids(locomo):
  b = locomo.banks[0]
  q = next(q for q in locomo.queries if q.text == "When did Caroline go to the LGBTQ support group?")
  assert q.gold == ("D1:3",) and q.category == "temporal"
  gm = corpus_lib.gold_mask(b, q.gold)
  gold_ids = [i for i, g in zip(b.ids, gm) if g]
  assert "D1:3" in gold_ids
  obs = [b.texts[b.ids.index(i)] for i in gold_ids if i.startswith("O")]
  assert "Caroline attended an LGBTQ support group recently and found the transgender stories inspiring." in obs
  # Every gold observation references a gold turn; every observation referencing one is gold.
  for i, refs, s, g in zip(b.ids, b.refs, b.stores, gm):
    if s == corpus_lib.STORE_OBSERVATION:
      assert g == ("D1:3" in refs)


def test_locomo_observation_refs_given_as_lists_or_comma_strings(locomo):
  multi = [r for bank in locomo.banks for r in bank.refs if len(r) > 1]
  assert ("D26:14", "D26:34", "D26:42") in multi  # conv-44, a comma-joined string
  assert ("D15:3", "D15:5") in multi  # conv-30, a list


def test_locomo_limit_takes_first_conversations(locomo_path):
  c = datasets.load_locomo(locomo_path, limit=1)
  assert c.stats["conversations"] == 1 and c.stats["sessions"] == 19
  assert all(q.group == 0 for q in c.queries)


# ---------------------------------------------------------------- LoCoMo, bad input

def _tiny_locomo():
  return [{
      "sample_id": "conv-x",
      "conversation": {
          "speaker_a": "Ann", "speaker_b": "Bo",
          "session_1_date_time": "1 May 2023", "session_2_date_time": "2 May 2023",
          "session_1": [{"speaker": "Ann", "dia_id": "D1:1", "text": "I got a puppy."},
                        {"speaker": "Bo", "dia_id": "D1:2", "text": "Cute!"}],
      },
      "observation": {"session_1_observation": {"Ann": [["Ann has a puppy.", "D1:1"]]}},
      "qa": [{"question": "What pet did Ann get?", "answer": "a puppy", "evidence": ["D1:1"],
              "category": 4},
             {"question": "Adversarial?", "adversarial_answer": "x", "evidence": ["D1:2"],
              "category": 5}],
  }]


def _write(tmp_path, name, obj):
  p = tmp_path / name
  p.write_text(json.dumps(obj))
  return p


def test_tiny_locomo_loads(tmp_path):
  c = datasets.load_locomo(_write(tmp_path, "locomo10.json", _tiny_locomo()))
  assert c.stats["sessions"] == 1 and c.stats["turns"] == 2 and c.stats["queries"] == 1
  assert c.banks[0].ids == ["D1:1", "D1:2", "O1:0"]
  assert c.banks[0].refs[2] == ("D1:1",)
  assert c.queries[0].gold == ("D1:1",) and c.queries[0].category == "single-hop"


def test_truncated_json_raises_naming_the_file(tmp_path):
  p = tmp_path / "locomo10.json"
  p.write_text(json.dumps(_tiny_locomo())[:150])
  with pytest.raises(ValueError, match=r"locomo10\.json.*(truncated|invalid JSON)"):
    datasets.load_locomo(p)


def test_truncated_gzip_raises_naming_the_file(tmp_path):
  p = tmp_path / "longmemeval_s.json.gz"
  blob = gzip.compress(LME_TINY.read_bytes())
  p.write_bytes(blob[:len(blob) // 2])
  with pytest.raises(ValueError, match=r"longmemeval_s\.json\.gz"):
    datasets.load_longmemeval(p)


def test_qa_item_without_evidence_field_raises_naming_the_item(tmp_path):
  data = _tiny_locomo()
  del data[0]["qa"][0]["evidence"]
  with pytest.raises(ValueError, match=r"conv-x.*qa item 0.*missing field 'evidence'"):
    datasets.load_locomo(_write(tmp_path, "locomo10.json", data))


def test_qa_item_with_empty_evidence_is_dropped_and_counted(tmp_path):
  data = _tiny_locomo()
  data[0]["qa"][0]["evidence"] = []
  c = datasets.load_locomo(_write(tmp_path, "locomo10.json", data))
  assert c.queries == [] and c.stats["queries_empty_evidence_dropped"] == 1


def test_missing_turn_field_raises_naming_field_and_turn(tmp_path):
  data = _tiny_locomo()
  del data[0]["conversation"]["session_1"][1]["dia_id"]
  with pytest.raises(ValueError, match=r"session_1 turn 1: missing field 'dia_id'"):
    datasets.load_locomo(_write(tmp_path, "locomo10.json", data))


def test_missing_category_raises(tmp_path):
  data = _tiny_locomo()
  del data[0]["qa"][0]["category"]
  with pytest.raises(ValueError, match=r"qa item 0: missing field 'category'"):
    datasets.load_locomo(_write(tmp_path, "locomo10.json", data))


def test_locomo_empty_bank_raises(tmp_path):
  data = _tiny_locomo()
  del data[0]["conversation"]["session_1"]
  with pytest.raises(ValueError, match=r"conv-x.*empty memory bank"):
    datasets.load_locomo(_write(tmp_path, "locomo10.json", data))


# ---------------------------------------------------------------- LongMemEval

@pytest.fixture(scope="module")
def lme_tiny():
  return datasets.load_longmemeval(LME_TINY)


def test_longmemeval_fixture_turn_ids_follow_the_official_protocol(lme_tiny):
  b = lme_tiny.banks[0]  # filler session then answer_ session; user turns only, i counts all turns
  assert b.ids == ["sharegpt_Xy12abc_0_1", "sharegpt_Xy12abc_0_3", "answer_5f1e2a_1_1",
                   "answer_5f1e2a_1_3"]
  assert b.texts[2] == "I need tips for training my border collie, Rex."
  assert lme_tiny.banks[3].ids == ["answer_aa11_1_2", "6b8e8bb3_1_1", "answer_aa11_2_1",
                                   "answer_aa11_2_3"]


def test_longmemeval_fixture_gold_sets(lme_tiny):
  q = {x.id: x for x in lme_tiny.queries}
  assert q["a1b2c3d4"].gold == ("answer_5f1e2a_1_1",)
  assert q["a1b2c3d4"].category == "single-session-user" and q["a1b2c3d4"].group == 0
  assert q["gpt4_0c1d2e3f"].gold == ("answer_aa11_1_2", "answer_aa11_2_1")
  assert q["gpt4_0c1d2e3f"].group == 3


def test_longmemeval_fixture_exclusions(lme_tiny):
  ids = [x.id for x in lme_tiny.queries]
  assert "a1b2c3d4_abs" not in ids  # _abs question
  assert "e5f6a7b8" not in ids  # gold only in an assistant turn
  assert ids == ["a1b2c3d4", "gpt4_0c1d2e3f"]
  s = lme_tiny.stats
  assert (s["questions"], s["queries_evaluable"], s["questions_abs_excluded"],
          s["questions_without_gold_excluded"]) == (4, 2, 1, 1)
  assert s["user_turns"] == 4 + 1 + 2 + 4 and s["turns"] == 8 + 2 + 4 + 6
  assert s["sessions"] == 2 + 1 + 2 + 3


def test_longmemeval_json_gz_equals_json(tmp_path, lme_tiny):
  p = tmp_path / "longmemeval_oracle.json.gz"
  p.write_bytes(gzip.compress(LME_TINY.read_bytes()))
  c = datasets.load_longmemeval(p)
  assert [q.gold for q in c.queries] == [q.gold for q in lme_tiny.queries]
  assert [b.ids for b in c.banks] == [b.ids for b in lme_tiny.banks]


def test_longmemeval_missing_field_raises_naming_the_question(tmp_path):
  data = json.loads(LME_TINY.read_text())
  del data[3]["haystack_sessions"]
  with pytest.raises(ValueError, match=r"question 'gpt4_0c1d2e3f': missing field 'haystack_sessions'"):
    datasets.load_longmemeval(_write(tmp_path, "lme.json", data))


def test_longmemeval_empty_bank_raises(tmp_path):
  data = json.loads(LME_TINY.read_text())
  data[0]["haystack_sessions"] = [[{"role": "assistant", "content": "hi"}], []]
  with pytest.raises(ValueError, match=r"question 'a1b2c3d4': empty memory bank"):
    datasets.load_longmemeval(_write(tmp_path, "lme.json", data))


@pytest.mark.slow
def test_longmemeval_s_counts_on_the_real_file(longmemeval_s_path):
  c = datasets.load_longmemeval(longmemeval_s_path)
  s = c.stats
  if s["questions"] != 498:
    pytest.skip("not the 498-question copy of ../shared/data")
  assert s["queries_evaluable"] == len(c.queries) == 418
  assert s["questions_abs_excluded"] == 30 and s["questions_without_gold_excluded"] == 50
  assert s["user_turns"] == 121_864 and s["user_turns_distinct_texts"] == 93_672
  assert s["turns"] == 245_625
  assert sum(s["queries_per_category"].values()) == 418


# ---------------------------------------------------------------- JSONL

def test_jsonl_fixture_banks_gold_and_exclusions():
  c = datasets.load_jsonl(FIXTURES / "tiny_bank.jsonl")
  assert [b.ids for b in c.banks] == [["m1", "m2", "m3", "o1"], ["m1", "m2"]]
  assert c.banks[0].stores.tolist() == [0, 0, 0, 1] and c.banks[0].refs[3] == ("m1",)
  assert [(q.id, q.gold, q.group, q.category) for q in c.queries] == [
      ("q1", ("m1",), 0, "single-hop"), ("q2", ("m1",), 1, "all")]
  s = c.stats
  assert s["queries_empty_evidence_dropped"] == 1 and s["queries_without_gold_excluded"] == 1
  assert s["evidence_ids_dropped"] == 1
  assert corpus_lib.gold_mask(c.banks[0], c.queries[0].gold).tolist() == [True, False, False, True]


@pytest.mark.parametrize("lines, pattern", [
    (['{"type": "memory", "id": "m1", "text": "x"}', '{"type": "query", "text": "q"'],
     r"line 2: invalid JSON"),
    (['{"type": "memory", "id": "m1", "text": "x"}', '{"type": "query", "text": "q"}'],
     r"line 2: missing field 'gold'"),
    (['{"type": "memory", "text": "x"}'], r"line 1: missing field 'id'"),
    (['{"type": "query", "text": "q", "gold": ["a"]}'], r"empty memory bank"),
    (['{"type": "memory", "id": "m1", "text": "x", "store": "cloud"}'], r"line 1: unknown store"),
    (['{"type": "memory", "id": "m1", "text": "x"}', '{"type": "memory", "id": "m1", "text": "y"}'],
     r"line 2: duplicate memory id 'm1'"),
])
def test_jsonl_bad_input_raises_naming_line_and_field(tmp_path, lines, pattern):
  p = tmp_path / "bank.jsonl"
  p.write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=pattern):
    datasets.load_jsonl(p)


# ---------------------------------------------------------------- data dir, split

def test_data_dir_resolution_order(tmp_path, monkeypatch):
  monkeypatch.setenv("EAR_DATA_DIR", str(tmp_path / "env"))
  assert datasets.resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"
  assert datasets.resolve_data_dir() == tmp_path / "env"
  monkeypatch.delenv("EAR_DATA_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert datasets.resolve_data_dir() == tmp_path / "xdg" / "ear_jax" / "data"


def test_missing_benchmark_file_says_what_to_put_where(tmp_path):
  with pytest.raises(FileNotFoundError) as e:
    datasets.find_benchmark_file("locomo", tmp_path)
  msg = str(e.value)
  assert str(tmp_path / "locomo10.json") in msg
  assert "https://github.com/snap-research/LoCoMo/raw/main/data/locomo10.json" in msg
  assert "experiments.download" in msg


def test_registry_dispatches_names_prefixes_and_paths(tmp_path, lme_tiny):
  for name, entry in datasets.REGISTRY.items():  # a download lands under a name the loader finds
    assert all(s.filename in entry.files for s in sources.SOURCES.get(name, ()))
  p = tmp_path / "any_name.json"
  p.write_bytes(LME_TINY.read_bytes())
  assert [q.id for q in datasets.load_corpus(f"longmemeval:{p}").queries] == ["a1b2c3d4", "gpt4_0c1d2e3f"]
  assert datasets.load_corpus(str(LME_TINY)).stats == lme_tiny.stats
  with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
    datasets.load_corpus("nope")
  with pytest.raises(ValueError, match="jsonl:<path>"):
    datasets.load_corpus("jsonl")


def test_a_new_benchmark_is_one_loader_and_one_registry_line(tmp_path, monkeypatch):
  def load_toy(path, *, limit=None):
    return corpus_lib.Corpus("toy", [], [], {"file": str(path), "limit": limit})

  monkeypatch.setitem(datasets.REGISTRY, "toy", datasets.CorpusLoader(load_toy, ("toy.json",)))
  (tmp_path / "toy.json").write_text("[]")
  assert datasets.load_corpus("toy", data_dir=tmp_path, limit=3).stats == {
      "file": str(tmp_path / "toy.json"), "limit": 3}
  with pytest.raises(FileNotFoundError, match=r"toy\.json"):
    datasets.find_benchmark_file("toy", tmp_path / "elsewhere")


def test_split_is_80_20_disjoint_and_seeded():
  tr, te = datasets.split_indices(1536, seed=0)
  assert len(tr) == 1228 and len(te) == 308
  assert sorted(np.concatenate([tr, te]).tolist()) == list(range(1536))
  tr2, te2 = datasets.split_indices(1536, seed=0)
  np.testing.assert_array_equal(tr, tr2)
  tr3, _ = datasets.split_indices(1536, seed=1)
  assert not np.array_equal(tr, tr3)
  np.testing.assert_array_equal(np.concatenate([tr, te]),
                                np.random.default_rng(0).permutation(1536))
  assert len(datasets.split_indices(418, 0)[0]) == 334
