"""Pictures of a ``KernelExplanation``: one panel per operand (its array as a
2-D image tiled into blocks, coloured by the first grid step that touches
each element or by the number of visits) and one of the grid itself.

matplotlib is imported here only, lazily, and only through ``Figure`` +
``FigureCanvasAgg``: no pyplot, so the user's backend and global state are
left alone.
"""
from __future__ import annotations

import io
import os

import numpy as np

EXTRA_HINT = "pip install 'pallas-np[viz]'"
UNMAPPED = "#e4e4e4"     # elements no grid step touches
PADDING = "#6e6e6e"      # hatch over edge-block padding
UNWRITTEN = "#d62728"    # cross-hatch over output elements nobody wrote
SKIPPED = "#9e9e9e"      # grid steps whose body touched nothing
MAX_RECTS = 3000         # hatch rectangles per panel before falling back to a tint
MAX_LINES = 120          # block boundaries per axis worth drawing
MAX_LABELS = 64          # tiles / grid cells labelled with their number


def _matplotlib():
  # matplotlib is an optional dependency (the viz extra): imported on first picture.
  try:
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib import colors, patches
  except ImportError as e:
    raise ImportError(
        "pallas_np.explain pictures need matplotlib, which is not installed: "
        f"{EXTRA_HINT} (the text summary and access maps work without it)") from e
  return matplotlib, Figure, FigureCanvasAgg, colors, patches


def figure(kexp, *, color: str = "first_step", source: str = "auto",
           view: str = "flatten", columns: int = 4):
  """The picture as a matplotlib ``Figure`` (not attached to pyplot).

  ``color``: "first_step" (first grid step touching each element; the grid
  panel uses the same colours) or "visits" (how many steps touch it).
  ``source``: "index_map" (blocks the index maps select: what the pipeline
  copies), "recorded" (elements the body read or wrote, DMAs included) or
  "auto" (recorded for whole-array/ANY operands and for inputs the body
  skipped in some step, index maps otherwise). ``view``: "flatten" (leading
  dims flattened into rows) or "last2" (the last two dims, leading dims
  folded: first step = min, visits = sum)."""
  if color not in ("first_step", "visits"):
    raise ValueError(f"color must be 'first_step' or 'visits', got {color!r}")
  if source not in ("auto", "index_map", "recorded"):
    raise ValueError(f"source must be 'auto', 'index_map' or 'recorded', got {source!r}")
  if view not in ("flatten", "last2"):
    raise ValueError(f"view must be 'flatten' or 'last2', got {view!r}")
  _, Figure, FigureCanvasAgg, colors, patches = _matplotlib()
  panels = len(kexp.operands) + 1
  ncols = min(columns, panels)
  nrows = -(-panels // ncols)
  fig = Figure(figsize=(3.9 * ncols + 1.2, 3.9 * nrows + 0.9), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
  steps = max(kexp.num_steps, 1)
  step_cmap = _step_cmap(steps)
  step_norm = colors.Normalize(-0.5, steps - 0.5)
  max_visits = max([int(_source_arrays(o, source)[0].max(initial=0)) for o in kexp.operands]
                   + [1])
  mpl = _matplotlib()[0]
  visit_cmap = mpl.colormaps["YlGnBu"].resampled(min(max_visits, 16)).with_extremes(
      bad=UNMAPPED)
  visit_norm = colors.Normalize(0.5, max_visits + 0.5)
  shown = set()  # overlays drawn somewhere: their legend entries
  for ax, o in zip(axes, kexp.operands):
    shown |= _operand_panel(ax, o, kexp, color, source, view, step_cmap, step_norm,
                            visit_cmap, visit_norm, patches)
  shown |= _grid_panel(axes[len(kexp.operands)], kexp, step_cmap, step_norm, patches)
  for ax in axes[panels:]:
    ax.set_visible(False)
  sm = mpl.cm.ScalarMappable(step_norm, step_cmap)
  cb = fig.colorbar(sm, ax=list(axes[:panels]), location="right", shrink=0.8, pad=0.01)
  cb.set_label("grid step (first to touch)" if color == "first_step" else "grid step")
  _int_ticks(cb, steps)
  if color == "visits":
    vm = mpl.cm.ScalarMappable(visit_norm, visit_cmap)
    cv = fig.colorbar(vm, ax=list(axes[:panels]), location="right", shrink=0.8, pad=0.01)
    cv.set_label("visits (grid steps touching the element)")
    _int_ticks(cv, max_visits + 1, start=1)
  legend = {
      "untouched": patches.Patch(facecolor=UNMAPPED, edgecolor="#999999",
                                 label="never touched"),
      "padding": patches.Patch(facecolor="white", edgecolor=PADDING, hatch="////",
                               label="edge-block padding (no data)"),
      "unwritten": patches.Patch(facecolor="white", edgecolor=UNWRITTEN, hatch="xxx",
                                 label="output never written"),
      "skipped": patches.Patch(facecolor=SKIPPED, edgecolor="#555555", hatch="..",
                               label="grid step touched no ref")}
  handles = [h for key, h in legend.items() if key in shown]
  label = "tiles: first grid step" if color == "first_step" else "tiles: visits"
  handles.insert(0, patches.Patch(facecolor="none", edgecolor="none",
                                  label=label + ("  (xN: visited by N steps)"
                                                 if color == "first_step" else "")))
  fig.legend(handles=handles, loc="outside lower center", ncols=len(handles),
             frameon=False, fontsize=9)
  sem = f", {'/'.join(kexp.dimension_semantics)}" if kexp.dimension_semantics else ""
  fig.suptitle(f"kernel '{kexp.name}': grid {kexp.grid}{sem}", fontsize=12)
  return fig


def save(kexp, path: str, **options) -> str:
  fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
  fig = figure(kexp, **options)
  fig.savefig(path, format=fmt, dpi=110)
  return path


def to_bytes(kexp, fmt: str, **options) -> bytes:
  fig = figure(kexp, **options)
  buf = io.BytesIO()
  fig.savefig(buf, format=fmt, dpi=90)
  return buf.getvalue()


# -- panels ---------------------------------------------------------------------
def _source_arrays(o, source):
  """(visits, first_step) over the padded shape, from the chosen source."""
  recorded = source == "recorded" or (source == "auto" and o.uses_recorded())
  if recorded:
    return o.padded_recorded_visits, o.padded_recorded_first_step
  return o.padded_visits, o.padded_first_step


def _operand_panel(ax, o, kexp, color, source, view, step_cmap, step_norm,
                   visit_cmap, visit_norm, patches):
  visits, first = _source_arrays(o, source)
  recorded = visits is o.padded_recorded_visits
  padding = o.padding
  unwritten = (~o.padded_written & ~padding) if o.is_output else np.zeros_like(padding)
  visits2, first2, pad2, unw2 = _to_2d([visits, first, padding, unwritten], view,
                                      ["sum", "min", "all", "any"])
  counts = np.ma.masked_less_equal(visits2.astype(float), 0)
  if color == "first_step":
    data = np.ma.masked_less(first2.astype(float), 0)
    cmap, norm = step_cmap, step_norm
  else:
    data = counts
    cmap, norm = visit_cmap, visit_norm
  rows, cols = data.shape
  ax.imshow(data, cmap=cmap, norm=norm, interpolation="nearest",
            aspect="equal" if max(rows, cols) <= 6 * min(rows, cols) else "auto")
  if o.unblocked:  # no blocks: cut where what the steps touched changes
    row_cuts, col_cuts = _value_cuts(first2)
    style = dict(color="white", lw=0.8, ls="--")
  else:
    row_cuts, col_cuts = _block_cuts(o, view, rows, cols)
    style = dict(color="white", lw=1.2)
  for r in row_cuts:
    ax.axhline(r - 0.5, **style)
  for c in col_cuts:
    ax.axvline(c - 0.5, **style)
  shown = set()
  if _hatch(ax, pad2, PADDING, "////", patches):
    shown.add("padding")
  if _hatch(ax, unw2, UNWRITTEN, "xxx", patches):
    shown.add("unwritten")
  if np.ma.count_masked(data):
    shown.add("untouched")
  _label_tiles(ax, data, counts if color == "first_step" else None,
               row_cuts, col_cuts, rows, cols)
  kind = "out" if o.is_output else "in"
  if o.unblocked:
    how = f"whole array ({o.memory_space}); recorded accesses"
  else:
    block = "(" + ", ".join("None" if b is None else str(b) for b in o.block_shape) + ")"
    how = f"block {block}; " + ("recorded accesses" if recorded else "index maps")
  ax.set_title(f"{kind}: {o.label}  {o.dtype.name}{list(o.shape)}\n{how}", fontsize=9)
  nd = len(o.padded_shape)
  ax.set_xlabel(f"dim {nd - 1}" if nd else "", fontsize=8)
  ylabel = ("dims " + ",".join(map(str, range(nd - 1))) + " flattened" if view == "flatten"
            and nd > 2 else f"dim {nd - 2}" if nd >= 2 else "")
  ax.set_ylabel(ylabel, fontsize=8)
  ax.tick_params(labelsize=7)
  return shown


def _grid_panel(ax, kexp, step_cmap, step_norm, patches):
  grid = kexp.grid
  rows = int(np.prod(grid[:-1], dtype=np.int64)) if len(grid) > 1 else 1
  cols = grid[-1] if grid else 1
  steps = np.arange(kexp.num_steps, dtype=float).reshape(rows, cols)
  steps = np.ma.masked_where(~kexp.ran.reshape(rows, cols), steps)
  ax.imshow(steps, cmap=step_cmap, norm=step_norm, interpolation="nearest",
            aspect="equal" if max(rows, cols) <= 6 * min(rows, cols) else "auto")
  skipped = (kexp.ran & (kexp.step_accesses == 0)).reshape(rows, cols)
  for r, c in np.argwhere(skipped):
    ax.add_patch(patches.Rectangle((c - 0.5, r - 0.5), 1, 1, facecolor=SKIPPED,
                                   edgecolor="#555555", hatch="..", lw=0))
  if rows * cols <= MAX_LABELS:  # program ids (<= 2 axes) or step numbers
    for s, point in enumerate(kexp.step_points):
      r, c = divmod(s, cols)
      text = ("(" + ",".join(str(int(p)) for p in point) + ")") if len(point) <= 2 else str(s)
      ax.text(c, r, text, ha="center", va="center", fontsize=7 if cols > 6 else 8,
              color=_ink(step_cmap(step_norm(s))))
  if cols <= 16:
    ax.set_xticks(range(cols))
  if rows <= 16:
    ax.set_yticks(range(rows))
    if len(grid) > 2:
      lead = np.unravel_index(np.arange(rows), grid[:-1])
      ax.set_yticklabels(["(" + ",".join(str(int(a[r])) for a in lead) + ")"
                          for r in range(rows)])
  if rows * cols <= 400:
    for r in range(1, rows):
      ax.axhline(r - 0.5, color="white", lw=0.8)
    for c in range(1, cols):
      ax.axvline(c - 0.5, color="white", lw=0.8)
  what = "program ids" if len(grid) <= 2 else "step numbers"
  ax.set_title(f"grid {grid}: {what}\ncolour = step order (last axis fastest)", fontsize=9)
  ax.set_xlabel(f"grid axis {len(grid) - 1}" if grid else "", fontsize=8)
  ax.set_ylabel(("grid axis 0" if len(grid) == 2 else
                 "grid axes " + ",".join(map(str, range(len(grid) - 1))))
                if len(grid) > 1 else "", fontsize=8)
  ax.tick_params(labelsize=7)
  return {"skipped"} if skipped.any() else set()


# -- helpers --------------------------------------------------------------------
def _to_2d(arrays, view, reducers):
  out = []
  for arr, how in zip(arrays, reducers):
    if arr.ndim == 0:
      arr = arr.reshape(1, 1)
    elif arr.ndim == 1:
      arr = arr.reshape(1, -1)
    elif view == "flatten":
      arr = arr.reshape(-1, arr.shape[-1])
    elif arr.ndim > 2:
      lead = tuple(range(arr.ndim - 2))
      if how == "min":  # earliest non-negative step
        arr = np.where(arr < 0, np.iinfo(np.int64).max, arr).min(axis=lead)
        arr = np.where(arr == np.iinfo(np.int64).max, -1, arr)
      else:
        arr = {"sum": np.sum, "all": np.all, "any": np.any}[how](arr, axis=lead)
    out.append(arr)
  return out


def _block_cuts(o, view, rows, cols):
  """Row and column positions where a new block starts in the 2-D view."""
  shape, kinds, sizes = o.padded_shape, o.kinds, o.block_sizes
  if not shape:
    return [], []

  def block_of(d, idx):
    return idx // sizes[d] if kinds[d] == "blocked" else idx if kinds[d] == "squeezed" \
        else np.zeros_like(idx)
  last = len(shape) - 1
  col_ids = block_of(last, np.arange(shape[last]))
  col_cuts = list(np.flatnonzero(np.diff(col_ids)) + 1)
  if len(shape) == 1:
    row_cuts = []
  else:
    lead = range(last) if view == "flatten" else [last - 1]
    lead_shape = [shape[d] for d in lead]
    idx = np.unravel_index(np.arange(rows), lead_shape)
    ids = np.stack([block_of(d, i) for d, i in zip(lead, idx)], axis=1)
    row_cuts = list(np.flatnonzero(np.any(np.diff(ids, axis=0) != 0, axis=1)) + 1)
  if len(row_cuts) > MAX_LINES:
    row_cuts = []
  if len(col_cuts) > MAX_LINES:
    col_cuts = []
  return row_cuts, col_cuts


def _value_cuts(values):
  """Rows/columns where a 2-D map changes (for operands without blocks)."""
  rows = list(np.flatnonzero(np.any(values[1:] != values[:-1], axis=1)) + 1)
  cols = list(np.flatnonzero(np.any(values[:, 1:] != values[:, :-1], axis=0)) + 1)
  return (rows if len(rows) <= MAX_LINES else []), (cols if len(cols) <= MAX_LINES else [])


def _label_tiles(ax, data, counts, row_cuts, col_cuts, rows, cols):
  r_edges = [0, *row_cuts, rows]
  c_edges = [0, *col_cuts, cols]
  tiles = (len(r_edges) - 1) * (len(c_edges) - 1)
  if tiles > MAX_LABELS or tiles < 1:
    return
  for r0, r1 in zip(r_edges, r_edges[1:]):
    for c0, c1 in zip(c_edges, c_edges[1:]):
      tile = data[r0:r1, c0:c1]
      if tile.count() == 0:
        continue
      lo, hi = int(tile.min()), int(tile.max())
      text = str(lo) if lo == hi else f"{lo}-{hi}"
      if counts is not None and counts[r0:r1, c0:c1].count():
        n = int(counts[r0:r1, c0:c1].max())
        text += f" x{n}" if n > 1 else ""
      rgba = ax.images[0].cmap(ax.images[0].norm(lo))
      ax.text((c0 + c1 - 1) / 2, (r0 + r1 - 1) / 2, text, ha="center", va="center",
              fontsize=9 if tiles <= 16 else 7, color=_ink(rgba), fontweight="bold")


def _hatch(ax, mask, color, hatch, patches) -> bool:
  if not mask.any():
    return False
  rects = _mask_rects(mask)
  if rects is None:  # too fragmented to hatch: a translucent tint instead
    tint = np.zeros((*mask.shape, 4))
    tint[mask] = (*_rgb(color), 0.55)
    ax.imshow(tint, interpolation="nearest", aspect=ax.get_aspect())
    return True
  for r0, c0, h, w in rects:
    ax.add_patch(patches.Rectangle((c0 - 0.5, r0 - 0.5), w, h, fill=False, hatch=hatch,
                                   edgecolor=color, lw=0))
  # an outline, so thin regions stay visible
  for r0, c0, h, w in rects[:MAX_LABELS]:
    ax.add_patch(patches.Rectangle((c0 - 0.5, r0 - 0.5), w, h, fill=False,
                                   edgecolor=color, lw=0.8))
  return True


def _mask_rects(mask):
  """Cover a 2-D bool mask with rectangles (row runs merged downwards);
  None when that needs more than MAX_RECTS."""
  done: list = []
  open_: dict = {}  # (c0, c1) -> [r0, height]
  for r, row in enumerate(mask):
    padded = np.concatenate([[False], row, [False]])
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    runs = set(zip(edges[::2].tolist(), edges[1::2].tolist()))
    for key in list(open_):
      if key not in runs:
        r0, h = open_.pop(key)
        done.append((r0, key[0], h, key[1] - key[0]))
    for key in runs:
      if key in open_:
        open_[key][1] += 1
      else:
        open_[key] = [r, 1]
    if len(done) + len(open_) > MAX_RECTS:
      return None
  done += [(r0, c0, h, c1 - c0) for (c0, c1), (r0, h) in open_.items()]
  return done


def _step_cmap(steps: int):
  import matplotlib  # optional dependency, see _matplotlib
  cmap = matplotlib.colormaps["viridis"].resampled(steps) if steps <= 32 else \
      matplotlib.colormaps["viridis"]
  return cmap.with_extremes(bad=UNMAPPED)


def _int_ticks(cb, n, start=0):
  if n - start <= 12:
    cb.set_ticks(range(start, n))


def _ink(rgba) -> str:
  r, g, b = rgba[:3]
  return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _rgb(color: str):
  from matplotlib import colors  # optional dependency, see _matplotlib
  return colors.to_rgb(color)
