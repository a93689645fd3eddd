"""``python -m pallas_np script.py args...`` (or ``python -m pallas_np -m
module args...``): run an unmodified program with every ``pallas_call`` in the
NumPy interpreter, whatever ``interpret=`` it passes (True, False, TPU/GPU
interpret params)."""
from __future__ import annotations

import os
import runpy
import sys

import pallas_np
from pallas_np import cli_args
from pallas_np.explainer import Explanation, KernelExplanation
from pallas_np.explainer.record import ExplainSession
from pallas_np.params import default_params

def print_grid_report(file=sys.stderr) -> None:
  rows = pallas_np.grid_report()
  print(f"pallas_np grid report ({len(rows)} kernels):", file=file)
  for r in rows:
    why = f"  ({r['why']})" if r["why"] else ""
    layout = f" ({r['layout']})" if r.get("layout") else ""
    print(f"  {r['kernel']}  grid {r['grid']}: {r['mode'] or 'never run'}{layout}{why}",
          file=file)


def main(argv: list[str] | None = None) -> None:
  command = cli_args.parse(sys.argv[1:] if argv is None else argv, pallas_np.__version__)
  options = dict(command.options)
  report, explain_dir, argv = command.grid_report, command.explain_dir, command.program
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
