"""The paper's numbers that the suites print beside the measured ones, and table-cell formatting."""
from __future__ import annotations

import numpy as np

# The paper's numbers (percent). Contriever retriever, simulated critic P=0.88 / R=0.86, 3 runs.
PAPER = {
    # Table 2: (Recall@5, Hitrate@5). EAR with explorer at test (Section 4.4: "unless specified").
    "main": {
        "longmemeval": {"retriever": (62.37, 86.02), "rl_update": (59.71, 82.08),
                        "ear": (80.28, 94.98)},
        "locomo": {"retriever": (42.60, 52.01), "rl_update": (25.97, 34.31),
                   "ear": (55.06, 70.83)},
    },
    # Table 3: Recall@5. (run, test-time mode) -> value.
    "ablation": {
        "longmemeval": {("rl_update", "adapter"): 54.12, ("ear_no_replay", "adapter"): 69.91,
                        ("ear_no_explorer", "adapter"): 66.32, ("ear", "adapter"): 72.80,
                        ("retriever", "explorer"): 68.81, ("ear", "explorer"): 80.28},
        "locomo": {("rl_update", "adapter"): 25.97, ("ear_no_replay", "adapter"): 39.99,
                   ("ear_no_explorer", "adapter"): 29.54, ("ear", "adapter"): 43.56,
                   ("retriever", "explorer"): 41.20, ("ear", "explorer"): 55.06},
    },
    # Tables 6-7 (LongMemEval only): Recall@5, explorer off at test.
    "hparams": {"longmemeval": {"T2B4": 68.5, "T4B4": 72.8, "T8B4": 69.5, "T4B2": 71.3,
                                "T4B8": 71.0, "similarity": 72.8, "reward": 69.9,
                                "random": 70.3}},
    # Table 5 (LoCoMo, dialogue + observations): (Recall@5 dialogue, Recall@5 observations).
    "multistore": {
        "retriever": {"single-hop": (32.95, 63.58), "multi-hop": (1.89, 16.98),
                      "temporal": (26.56, 60.94), "open-domain": (5.56, 22.22)},
        "ear": {"single-hop": (54.33, 62.43), "multi-hop": (7.55, 16.67),
                "temporal": (46.88, 53.13), "open-domain": (16.67, 22.22)},
    },
    # Figures: only qualitative statements / read-off numbers are given in the text.
    "curves": {
        "fig3": "LongMemEval, explorer off: RL update drops ~10 points below the retriever at first, "
                "EAR at most ~3; EAR passes the retriever after ~80 training queries.",
        "fig4": "Matched critic budget (RL update 4 epochs = 1600 calls): RL update passes the "
                "retriever after ~1400 critic calls, EAR after ~320; EAR stays ahead.",
    },
    "noise": "Fig. 5: EAR stays above the retriever even at precision = recall = 0.70.",
    "fig6": "Fig. 6: the retriever's top-5 is mostly observations; EAR's is more balanced.",
    "appendix_c": "Table 12: Delta_before ~ 0; after the adapter episodic queries get Delta < 0 "
                  "(-0.05..-0.10) and semantic queries Delta > 0 (+0.02..+0.15).",
}


# Printed under every table with 'mean ± std' cells.
CELL_NOTE = ("Cells 'a ± b': mean ± standard deviation over the seeds (population std; a spread, not "
             "a confidence interval) of the per-seed value, in percent unless the column says "
             "otherwise; each seed has its own 80/20 train/test split and PRNG keys. 'paper' "
             "columns: the paper's reported numbers (Contriever retriever, 3 runs).")


def with_cell_note(md: str) -> str:
  """`md` followed by `CELL_NOTE` when it holds a 'mean ± std' cell."""
  return md + "\n\n" + CELL_NOTE if " ± " in md else md


def fmt(ms, digits=2):
  """A `mean_std` dict as 'mean ± std' ('–' when missing)."""
  if ms is None or ms.get("mean") is None:
    return "–"
  return f"{ms['mean']:.{digits}f} ± {ms['std']:.{digits}f}"


def fmt_seeds(values, digits=2):
  """Per-seed values as 'mean ± std' (population std)."""
  v = np.asarray(values, np.float64)
  return fmt({"mean": float(v.mean()), "std": float(v.std())}, digits)


def fmt_num(v):
  """A number with two decimals ('–' for None), e.g. a paper value."""
  return "–" if v is None else f"{v:.2f}"


def md_table(header, rows):
  """A markdown table: `header` cells, then one row per list of cells."""
  out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return "\n".join(out)
