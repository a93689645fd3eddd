"""Chart of benchmarks/RESULTS.md: per kernel, cold (first call) and warm
times of each mode, log scale. Read back from the markdown table, so any
existing RESULTS.md can be plotted (``python benchmarks/suite.py
--plot-only``); ``suite.py --plot`` does it after a run. Needs matplotlib
(``pip install 'pallas-np[viz]'``); no pyplot (Figure + Agg canvas)."""
from __future__ import annotations

import os
import re

IMAGE_MARK = "![benchmark chart]"
COLORS = {"numpy": "#1f77b4", "interpret": "#ff7f0e", "tpu": "#2ca02c",
          "numpy_seq": "#9467bd", "trace": "#7f7f7f"}


def read_table(path: str) -> tuple[list[str], dict[str, dict[str, float]]]:
  """(kernel labels, {column name: {label: ms}}) of the times table (the
  file's first table); cells that are not numbers (errors, '-') are left
  out."""
  lines = []
  for l in open(path).read().splitlines():
    if l.startswith("| "):
      lines.append(l)
    elif lines and not l.startswith("|"):
      break
  if not lines:
    raise ValueError(f"{path}: no results table")
  head = [c.strip() for c in lines[0].strip("|").split("|")]
  labels, columns = [], {h: {} for h in head[1:]}
  for line in lines[1:]:
    cells = [c.strip() for c in line.strip("|").split("|")]
    label = re.sub(r"\s*\(`[^`]*`\)$", "", cells[0])
    labels.append(label)
    for h, c in zip(head[1:], cells[1:]):
      try:
        columns[h][label] = float(c)
      except ValueError:
        pass
  return labels, columns


def plot(results_md: str, out_png: str) -> str:
  try:
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
  except ImportError as e:
    raise ImportError("the benchmark chart needs matplotlib: pip install 'pallas-np[viz]'") from e
  labels, columns = read_table(results_md)
  modes = [h[:-len(" cold")] for h in columns if h.endswith(" cold")]
  fig = Figure(figsize=(12, 0.42 * len(labels) + 1.8), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, 2, sharey=True)
  width = 0.8 / max(len(modes), 1)
  for ax, key in zip(axes, ("cold", "warm")):
    for m, mode in enumerate(modes):
      col = columns.get(f"{mode} {key}", {})
      ys = [i + (m - (len(modes) - 1) / 2) * width for i in range(len(labels))]
      vals = [col.get(l) for l in labels]
      pts = [(y, v) for y, v in zip(ys, vals) if v is not None and v > 0]
      if pts:
        ax.barh([y for y, _ in pts], [v for _, v in pts], height=width,
                color=COLORS.get(mode), label=mode)
    ax.set_xscale("log")
    ax.set_title("first call (cold)" if key == "cold" else "warm call (median)")
    ax.set_xlabel("ms (log scale)")
    ax.grid(axis="x", which="major", alpha=0.3)
  axes[0].set_yticks(range(len(labels)))
  axes[0].set_yticklabels(labels, fontsize=8)
  axes[0].invert_yaxis()
  handles, names = axes[0].get_legend_handles_labels()
  fig.legend(handles, names, loc="outside lower center", ncols=max(len(names), 1), fontsize=9)
  fig.suptitle("pallas_np benchmarks: " + ", ".join(modes) + " (lower is better)")
  fig.savefig(out_png, dpi=100)
  return out_png


def link_in_results(results_md: str, png: str) -> None:
  """Show the chart in RESULTS.md (once), under its title."""
  text = open(results_md).read()
  if IMAGE_MARK in text:
    return
  rel = os.path.relpath(png, os.path.dirname(os.path.abspath(results_md)))
  lines = text.splitlines()
  at = 1 if lines and lines[0].startswith("# ") else 0
  lines[at:at] = ["", f"{IMAGE_MARK}({rel})"]
  with open(results_md, "w") as f:
    f.write("\n".join(lines) + ("\n" if text.endswith("\n") else ""))
