"""``python -m pallas_np script.py args...`` (or ``python -m pallas_np -m
module args...``): run an unmodified program with every ``pallas_call`` in the
NumPy interpreter, whatever ``interpret=`` it passes (True, False, TPU/GPU
interpret params)."""
from __future__ import annotations

import os
import runpy
import sys

import pallas_np
from pallas_np.explainer import Explanation, KernelExplanation
from pallas_np.explainer.record import ExplainSession
from pallas_np.params import default_params

USAGE = """usage: python -m pallas_np [options] [-m module | script.py] [args...]

options (InterpretParams for every pallas_call):
  --detect-races   report races between grid points on parallel axes
  --clamp          clamp out-of-bounds indices like interpret=True (default: raise)
  --zero           zero-fill uninitialised memory (default: NaN / int min)
  --pdb            drop into pdb at the failing eqn of a kernel
  --no-progress    no progress bar for long grids
  --grid-report    at exit, print how each kernel's grid ran and why it was not
                   batched (pallas_np.grid_report()) to stderr
  --explain OUTDIR write a picture of each kernel's grid and block accesses
                   (its first run) to OUTDIR/NN_kernel.png, and the text
                   summaries to OUTDIR/summary.txt (pallas_np.explain; the
                   pictures need pip install 'pallas-np[viz]')"""

_FLAGS = {"--detect-races": ("detect_races", True), "--clamp": ("bounds_check", "clamp"),
          "--zero": ("uninitialized", "zero"), "--pdb": ("pdb", True),
          "--no-progress": ("progress", False)}


def print_grid_report(file=sys.stderr) -> None:
  rows = pallas_np.grid_report()
  print(f"pallas_np grid report ({len(rows)} kernels):", file=file)
  for r in rows:
    why = f"  ({r['why']})" if r["why"] else ""
    layout = f" ({r['layout']})" if r.get("layout") else ""
    print(f"  {r['kernel']}  grid {r['grid']}: {r['mode'] or 'never run'}{layout}{why}",
          file=file)


def main(argv: list[str] | None = None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  options = {}
  report = False
  explain_dir = None
  while argv and (argv[0] in _FLAGS or argv[0] in ("--grid-report", "--explain")):
    flag = argv.pop(0)
    if flag == "--grid-report":
      report = True
      continue
    if flag == "--explain":
      if not argv:
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
      explain_dir = argv.pop(0)
      continue
    name, value = _FLAGS[flag]
    options[name] = value
  if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
    print(USAGE, file=sys.stderr)
    raise SystemExit(2)
  session = None
  if explain_dir is not None:
    session = ExplainSession(first_run_only=True)
    options.update(explain=session, vectorize=False, num_threads=1)
  pallas_np.set_numpy_interpret(default_params(**options))
  # PALLAS_NP_DEVICE=NAME: the device persona (docs/persona.md), same options.
  pallas_np.persona.from_environment(**options)
  try:
    if argv[0] == "-m":
      sys.argv = argv[1:]
      sys.path.insert(0, os.getcwd())
      runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
      sys.argv = argv
      sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
      runpy.run_path(argv[0], run_name="__main__")
  finally:
    if report:
      print_grid_report()
    if session is not None:
      write_explanations(session, explain_dir)


def write_explanations(session, outdir: str, file=sys.stderr) -> None:
  """Summaries first (they need no matplotlib), then one PNG per kernel."""
  explanation = Explanation(KernelExplanation(r) for r in session.close())
  os.makedirs(outdir, exist_ok=True)
  with open(os.path.join(outdir, "summary.txt"), "w") as f:
    f.write(str(explanation) + "\n")
  paths = explanation.save_all(outdir)
  print(f"pallas_np explain: {len(paths)} kernel picture(s) and summary.txt in {outdir}",
        file=file)


if __name__ == "__main__":
  main()
