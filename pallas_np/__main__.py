"""``python -m pallas_np script.py args...`` (or ``python -m pallas_np -m
module args...``): run an unmodified program with every ``pallas_call`` in the
NumPy interpreter, whatever ``interpret=`` it passes (True, False, TPU/GPU
interpret params)."""
from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m pallas_np [-m module | script.py] [args...]"


def main(argv: list[str] | None = None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
    print(USAGE, file=sys.stderr)
    raise SystemExit(2)
  import pallas_np
  pallas_np.set_numpy_interpret()
  if argv[0] == "-m":
    sys.argv = argv[1:]
    sys.path.insert(0, os.getcwd())
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
  else:
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
  main()
