"""The answer-grounded critic, its support features, and episodes that learn from it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ear_jax.core import critic
from ear_jax.core import episode
from ear_jax.core import stream as stream_lib
from ear_jax.core.config import EARConfig, default_hparams
from ear_jax.data import answer_support
from ear_jax.data import candidates
from ear_jax.experiment import critic_eval

INF = float("inf")


def _view(support, mask):
  support, mask = jnp.asarray(support, jnp.float32), jnp.asarray(mask)
  return critic.SlateView(query=jnp.zeros(2), slate=jnp.arange(mask.shape[0]), slate_mask=mask,
                          memories=jnp.zeros((mask.shape[0], 2)), gold=jnp.zeros(mask.shape, bool),
                          answer_support=support)


# Columns: new_words, new_word_share, answer_cosine, question_answer_cosine.
_SUPPORT = [[1, 0.5, 0.2, 0.40],  # one of the two new words
            [1, 0.5, 0.3, 0.50],  # ties on new words; higher question-answer cosine: the best
            [0, 0.0, 0.9, 0.85],  # no new word, very close to the question + answer
            [2, 1.0, 0.1, 0.30]]  # masked: never cited, never the best
_MASK = [True, True, True, False]


def test_support_counts_the_answers_new_content_words_in_each_memory():
  questions = ["Where did Caroline go hiking last week?"]
  answers = ["Caroline hiked in the Rocky Mountains"]  # new words: rocki, mountain
  texts = np.asarray([["We camped in the Rocky mountains.", "Mountains are big", "I went hiking",
                       ""]], object)
  mask = np.asarray([[True, True, True, False]])
  got = answer_support.lexical_support(questions, answers, texts, mask)
  np.testing.assert_allclose(got[0, :, 0], [2, 1, 0, 0])  # 'hiked' / 'hiking' are in the question
  np.testing.assert_allclose(got[0, :, 1], [1.0, 0.5, 0.0, 0.0])


def test_support_is_zero_for_an_answer_the_question_already_holds():
  got = answer_support.lexical_support(["Is Paris in France?"], ["France"],
                                       np.asarray([["Paris is in France"]], object),
                                       np.ones((1, 1), bool))
  np.testing.assert_array_equal(got, 0.0)


def test_embedding_support_is_the_cosine_with_answer_and_question_answer():
  a = np.asarray([[1.0, 0.0]])
  qa = np.asarray([[0.6, 0.8]])
  cands = np.asarray([[[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]])
  mask = np.asarray([[True, True, False]])
  got = answer_support.embedding_support(a, qa, cands, mask)
  np.testing.assert_allclose(got[0], [[1.0, 0.6], [0.0, 0.8], [0.0, 0.0]], rtol=1e-6)


def test_answer_critic_cites_the_best_supported_memory_and_the_branches_that_fire():
  view = _view(_SUPPORT, _MASK)
  only_best = critic.make_answer_critic(min_overlap=1, best_min_cosine=INF, min_share=INF,
                                        min_cosine=INF)
  np.testing.assert_array_equal(only_best(None, view), [-1, 1, -1, -1])
  by_share = critic.make_answer_critic(min_overlap=INF, best_min_cosine=INF, min_share=0.5,
                                       min_cosine=INF)
  np.testing.assert_array_equal(by_share(None, view), [1, 1, -1, -1])
  by_cosine = critic.make_answer_critic(min_overlap=INF, best_min_cosine=INF, min_share=INF,
                                        min_cosine=0.8)
  np.testing.assert_array_equal(by_cosine(None, view), [-1, -1, 1, -1])
  nothing = critic.make_answer_critic(min_overlap=2, best_min_cosine=0.6, min_share=0.75,
                                      min_cosine=0.9)
  np.testing.assert_array_equal(nothing(None, view), [-1, -1, -1, -1])


def test_answer_critic_under_jit_equals_eager_and_vmap_over_thresholds_equals_a_loop():
  view = _view(_SUPPORT, _MASK)
  settings = [dict(min_overlap=o, best_min_cosine=INF, min_share=sh, min_cosine=c)
              for o, sh, c in [(1, INF, INF), (INF, 0.5, INF), (INF, INF, 0.8), (2, 0.75, 0.9)]]
  crits = [critic.make_answer_critic(**s) for s in settings]
  call = lambda c, v: c(None, v)
  loop = np.stack([np.asarray(call(c, view)) for c in crits])
  jitted = np.stack([np.asarray(jax.jit(call)(c, view)) for c in crits])
  swept = np.asarray(jax.jit(jax.vmap(call, in_axes=(0, None)))(critic.stack_critics(crits),
                                                                 view))
  np.testing.assert_array_equal(jitted, loop)
  np.testing.assert_array_equal(swept, loop)


def test_answer_critic_without_support_names_the_missing_input():
  view = _view(_SUPPORT, _MASK)._replace(answer_support=None)
  with pytest.raises(ValueError, match="answer_support"):
    critic.make_answer_critic()(None, view)


def test_answer_critic_refuses_a_nan_threshold():
  with pytest.raises(ValueError, match="min_share"):
    critic.make_answer_critic(min_share=float("nan"))


def test_answer_critic_is_in_the_registry():
  assert isinstance(critic.CRITICS["answer"](), critic.AnswerCritic)


def _stream(with_support=True, n=8, k=6, d=4):
  rng = np.random.default_rng(0)
  q = rng.normal(size=(n, d))
  c = rng.normal(size=(n, k, d))
  q /= np.linalg.norm(q, axis=-1, keepdims=True)
  c /= np.linalg.norm(c, axis=-1, keepdims=True)
  gold = np.zeros((n, k), bool)
  gold[:, 2] = True
  support = np.zeros((n, k, len(critic.ANSWER_FEATURES)), np.float32)
  support[:, 2, :2] = (2.0, 1.0)  # the answer's two new words are in candidate 2
  return stream_lib.make_stream(q, c, gold=gold,
                                answer_support=support if with_support else None)


@pytest.mark.slow  # compiles a whole episode (about 5 s)
def test_episode_with_the_answer_critic_runs_under_jit_without_retrace():
  s = _stream()
  cfg = EARConfig(dim=4, num_candidates=6, slate_size=2, batch_size=2, replay_size=2,
                  buffer_capacity=8)
  run = jax.jit(episode.run_episode, static_argnames="config")
  lexical = dict(best_min_cosine=INF, min_share=INF, min_cosine=INF)
  _, rec = run(jax.random.PRNGKey(0), s, cfg, default_hparams(),
               critic.make_answer_critic(min_overlap=1.0, **lexical))
  size = run._cache_size()  # pylint: disable=protected-access
  run(jax.random.PRNGKey(1), s, cfg, default_hparams(),
      critic.make_answer_critic(min_overlap=2.0, **lexical))
  assert run._cache_size() == size  # pylint: disable=protected-access
  labels, slates, shown = (np.asarray(x) for x in (rec.labels, rec.slates, rec.slate_mask))
  cited = (labels > 0) & shown
  assert cited.any() and np.all(slates[cited] == 2)  # exactly the supported memory is cited


@pytest.mark.slow  # compiles a whole episode twice (about 10 s)
def test_answer_support_does_not_change_an_episode_with_the_simulated_critic():
  cfg = EARConfig(dim=4, num_candidates=6, slate_size=2, batch_size=2, replay_size=2,
                  buffer_capacity=8)
  run = jax.jit(episode.run_episode, static_argnames="config")
  with_s = run(jax.random.PRNGKey(3), _stream(True), cfg, default_hparams(), None)
  without = run(jax.random.PRNGKey(3), _stream(False), cfg, default_hparams(), None)
  for a, b in zip(jax.tree_util.tree_leaves(with_s), jax.tree_util.tree_leaves(without)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_make_stream_names_a_misshapen_answer_support():
  with pytest.raises(ValueError, match="answer_support must be"):
    stream_lib.make_stream(np.ones((2, 3)), np.ones((2, 4, 3)),
                           answer_support=np.zeros((2, 5, 4)))


def test_jitted_citations_match_the_critic_on_recorded_slates():
  s = _stream()
  slates = [critic_eval.SlateRecord(query=0, round=0, question="", texts=("a", "b"),
                                    gold=(False, True), positions=(1, 2)),
            critic_eval.SlateRecord(query=1, round=0, question="", texts=("a",), gold=(False,),
                                    positions=(0,))]
  best_with_a_new_word = critic.make_answer_critic(min_overlap=1, best_min_cosine=INF,
                                                   min_share=INF, min_cosine=INF)
  got = critic_eval.jitted_citations(best_with_a_new_word, s, slates, jax.random.PRNGKey(0),
                                     slate_size=2)
  assert got == [[1], []]
  always_the_best = critic.make_answer_critic(best_min_cosine=-INF, min_share=INF, min_cosine=INF)
  got = critic_eval.jitted_citations(always_the_best, s, slates, jax.random.PRNGKey(0), 2)
  assert got == [[1], [0]]
  oracle = critic_eval.jitted_citations(critic.OracleCritic(), s, slates, jax.random.PRNGKey(0), 2)
  assert oracle == [[1], []]  # a critic without parameters works too


def test_threshold_choice_is_the_highest_recall_at_the_precision_floor():
  def m(recall, precision):
    return {"protocol": {"recall": recall, "precision": precision},
            "all_slates": {"precision_all_slates": precision / 2}}
  settings = [{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}]
  metrics = [m(0.9, 0.5), m(0.6, 0.85), m(0.6, 0.9), m(0.4, 0.99)]
  assert critic_eval.choose_answer_thresholds(settings, metrics)["setting"] == {"i": 2}
  assert critic_eval.choose_answer_thresholds(settings, metrics, min_precision=0.999) is None
  every_slate = critic_eval.choose_answer_thresholds(
      settings, metrics, min_precision=0.45, precision=("all_slates", "precision_all_slates"))
  assert every_slate["setting"] == {"i": 2}


@pytest.mark.slow  # the LoCoMo file and the MiniLM encoder
def test_locomo_answer_support_from_the_gold_answers(locomo_path, minilm, tmp_path):
  bench = answer_support.with_answer_support(
      candidates.load_benchmark(
          "locomo", data_dir=locomo_path.parent, encoder=minilm, limit=1, progress=False,
          cache_dir=tmp_path), encoder=minilm, cache_dir=tmp_path)
  sup = np.asarray(bench.stream.answer_support)
  n, k = bench.stream.mask.shape
  assert sup.shape == (n, k, len(critic.ANSWER_FEATURES))
  assert np.all(sup[~np.asarray(bench.stream.mask)] == 0)
  # Row 0 by hand: the answer's new stemmed content words found in each candidate text.
  new = answer_support.content_words([bench.answers[0]])[0] - answer_support.content_words(
      [bench.query_texts[0]])[0]
  words = answer_support.content_words(list(bench.candidate_texts[0]))
  np.testing.assert_array_equal(sup[0, :, 0], [len(new & w) if m else 0 for w, m in
                                               zip(words, np.asarray(bench.stream.mask)[0])])
  assert np.all(np.abs(sup[..., 2:]) <= 1.0 + 1e-5)
  # The cited memories carry more of the answer than the rest (what the critic relies on).
  gold = np.asarray(bench.stream.gold)
  assert sup[..., 0][gold].mean() > 2 * sup[..., 0][~gold & np.asarray(bench.stream.mask)].mean()
