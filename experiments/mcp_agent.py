"""A scripted MCP agent over LoCoMo: does the memory server learn from an agent's feedback?

Talks to `ear-mcp-server` over stdio with the `mcp` SDK: `remember`s one conversation's turns,
measures held-out Recall@5 with `search`, answers the training questions with `recall` + `cite`,
and measures again. `--feedback=cite` sends the gold ids shown (a perfect citing critic);
`--feedback=answer` only the question's gold answer (no `cite` without one).

  python -m experiments.mcp_agent --locomo=../shared/data/locomo10.json --memory_dir=ear_mcp_run \\
      --conversation=0 --num_test=40 --epochs=2 --feedback=answer

Prints the numbers and one JSON line (`RESULT {...}`).
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
from typing import Optional

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]


def server_params(memory_dir, extra_args=(), env: Optional[dict] = None):
  """`StdioServerParameters` that start this repository's MCP server on `memory_dir`."""
  from mcp import StdioServerParameters  # pylint: disable=g-import-not-at-top
  full_env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
              "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), **(env or {})}
  return StdioServerParameters(
      command=sys.executable,
      args=["-m", "ear_jax.agent.mcp_cli", f"--memory_dir={memory_dir}", *extra_args],
      env=full_env, cwd=str(REPO))


async def call(session, tool: str, args: dict):
  """`(ok, payload)` of one tool call: the JSON result, or the error text."""
  res = await session.call_tool(tool, args)
  text = res.content[0].text if res.content else ""
  return (False, text) if res.isError else (True, json.loads(text))


async def must(session, tool: str, args: dict):
  """The JSON result of one tool call (RuntimeError with the error text)."""
  ok, out = await call(session, tool, args)
  if not ok:
    raise RuntimeError(f"{tool} failed: {out}")
  return out


def locomo_slice(path, conversation: int, num_test: int, seed: int = 0):
  """`(bank, train queries, test queries)` of one conversation (shuffled by `seed`)."""
  from ear_jax.data.locomo import load_locomo  # pylint: disable=g-import-not-at-top
  corpus = load_locomo(path, limit=conversation + 1)
  bank = corpus.banks[conversation]
  qs = [q for q in corpus.queries if q.group == conversation and q.gold]
  order = np.random.default_rng(seed).permutation(len(qs))
  qs = [qs[i] for i in order]
  return bank, qs[num_test:], qs[:num_test]


async def recall_at(session, queries, to_mem: dict, k: int = 5) -> dict:
  """Recall@k, the mean gold fraction in the slate and Hitrate@k of `search` over `queries`."""
  full, frac, hit = [], [], []
  for q in queries:
    out = await must(session, "search", {"question": q.text, "k": k})
    gold = {to_mem[g] for g in q.gold if g in to_mem}
    n = len({m["id"] for m in out["memories"]} & gold)
    full.append(n == len(gold))
    frac.append(n / max(len(gold), 1))
    hit.append(n > 0)
  return {"recall": float(np.mean(full)), "gold_fraction": float(np.mean(frac)),
          "hitrate": float(np.mean(hit))}


def dialogue_turns(bank) -> tuple[list[str], list[str]]:
  """`(dia ids, texts)` of the bank's dialogue turns (store 0)."""
  keep = [j for j, s in enumerate(bank.stores) if int(s) == 0]
  return [bank.ids[j] for j in keep], [bank.texts[j] for j in keep]


async def add_turns(session, bank, chunk: int = 256) -> dict:
  """`remember`s the bank's dialogue turns; returns {LoCoMo dia_id: memory id}."""
  ids, texts = dialogue_turns(bank)
  to_mem = {}
  for s in range(0, len(ids), chunk):
    out = await must(session, "remember", {"texts": texts[s:s + chunk]})
    to_mem.update(zip(ids[s:s + chunk], out["ids"]))
  return to_mem


FEEDBACK = ("cite", "answer")


async def train(session, queries, to_mem: dict, rounds: int, k: int = 5,
                feedback: str = "cite") -> tuple[int, int]:
  """Answers each question with `rounds` recall + cite rounds: `(ids cited, answers sent)`."""
  if feedback not in FEEDBACK:
    raise ValueError(f"feedback must be one of {FEEDBACK}, got {feedback!r}")
  cites = answers = 0
  for q in queries:
    gold = {to_mem[g] for g in q.gold if g in to_mem}
    answer = (q.answer or "").strip()
    for _ in range(rounds):
      out = await must(session, "recall", {"question": q.text, "k": k})
      if feedback == "cite":
        used = [m["id"] for m in out["memories"] if m["id"] in gold]
        await must(session, "cite", {"retrieval_id": out["retrieval_id"], "used_ids": used})
        cites += len(used)
      elif answer:
        await must(session, "cite", {"retrieval_id": out["retrieval_id"], "answer": answer})
        answers += 1
  return cites, answers


async def run(locomo, memory_dir, *, conversation: int = 0, num_test: int = 40, epochs: int = 2,
              server_args=(), seed: int = 0, feedback: str = "cite") -> dict:
  """The scripted agent (see the module docstring); returns the before / after numbers."""
  from mcp import ClientSession  # pylint: disable=g-import-not-at-top
  from mcp.client.stdio import stdio_client  # pylint: disable=g-import-not-at-top
  bank, train_qs, test_qs = locomo_slice(locomo, conversation, num_test, seed)
  async with stdio_client(server_params(memory_dir, server_args)) as (read, write):
    async with ClientSession(read, write) as session:
      await session.initialize()
      to_mem = await add_turns(session, bank)
      rounds = (await must(session, "stats", {}))["rounds_per_question"]
      before = await recall_at(session, test_qs, to_mem)
      cites = answers = 0
      for _ in range(epochs):
        c, a = await train(session, train_qs, to_mem, rounds, feedback=feedback)
        cites, answers = cites + c, answers + a
      after = await recall_at(session, test_qs, to_mem)
      stats = await must(session, "stats", {})
  return {"memories": len(to_mem), "train_questions": len(train_qs),
          "test_questions": len(test_qs), "epochs": epochs, "rounds": rounds,
          "before": before, "after": after, "feedback": feedback, "cites": cites,
          "answers": answers, "learner_steps": stats["learner_steps"]}


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  out = asyncio.run(run(f.locomo, f.memory_dir, conversation=f.conversation, num_test=f.num_test,
                        epochs=f.epochs, seed=f.seed, feedback=f.feedback,
                        server_args=[f"--method={f.method}", f"--candidates={f.candidates}"]
                        + ([f"--cache_dir={f.cache_dir}"] if f.cache_dir else [])))
  b, a = out["before"], out["after"]
  print(f"held-out Recall@5 through search: {100 * b['recall']:.2f} -> {100 * a['recall']:.2f}; "
        f"gold fraction {100 * b['gold_fraction']:.2f} -> {100 * a['gold_fraction']:.2f}; "
        f"Hitrate@5 {100 * b['hitrate']:.2f} -> {100 * a['hitrate']:.2f} "
        f"({out['test_questions']} questions; feedback={out['feedback']}; "
        f"{out['train_questions']} training questions x {out['epochs']} epochs x "
        f"{out['rounds']} rounds; {out['learner_steps']} learner steps)")
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  from absl import app, flags  # pylint: disable=g-import-not-at-top,g-multiple-import
  flags.DEFINE_string("locomo", None, "locomo10.json", required=True)
  flags.DEFINE_string("memory_dir", None, "A NEW memory directory for the server.",
                      required=True)
  flags.DEFINE_integer("conversation", 0, "LoCoMo conversation index.")
  flags.DEFINE_integer("num_test", 40, "Held-out questions.")
  flags.DEFINE_integer("epochs", 2, "Passes over the training questions.")
  flags.DEFINE_integer("seed", 0, "Question shuffle seed.")
  flags.DEFINE_enum("feedback", "cite", ["cite", "answer"],
                    "What cite sends: the gold ids shown (cite) or only the gold answer (answer).")
  flags.DEFINE_string("method", "ear_tuned", "--method of the server.")
  flags.DEFINE_string("candidates", "dense", "--candidates of the server.")
  flags.DEFINE_string("cache_dir", None, "--cache_dir of the server (embedding cache).")
  app.run(main)
