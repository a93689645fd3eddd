"""The command line of ``python -m pallas_np``: its flags, its usage text and
their parsing, in a module that imports neither JAX nor the rest of
pallas_np.

Why a module of its own: ``python -m pallas_np`` runs ``pallas_np/__init__``
(which imports JAX, seconds) before ``__main__`` reads a flag. ``__init__``
calls ``answer_without_jax`` first, so ``--help``, ``--version`` and a
malformed command line are answered in the time Python takes to start.
"""
from __future__ import annotations

import sys
from typing import NamedTuple

USAGE = """usage: python -m pallas_np [options] [-m module | script.py] [args...]

Runs an unmodified program with every pallas_call in the NumPy interpreter,
whatever interpret= it passes.

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
                   pictures need pip install 'pallas-np[viz]')
  -h, --help       print this help and exit
  --version        print pallas_np's version and exit"""

# Flags that set one InterpretParams field: flag -> (field, value).
PARAM_FLAGS = {"--detect-races": ("detect_races", True), "--clamp": ("bounds_check", "clamp"),
               "--zero": ("uninitialized", "zero"), "--pdb": ("pdb", True),
               "--no-progress": ("progress", False)}


class Command(NamedTuple):
  """A parsed command line: what to run and how."""
  options: dict          # InterpretParams fields set by flags
  grid_report: bool
  explain_dir: str | None
  program: list          # ["-m", module, args...] or [script.py, args...]


def usage_error(message: str):
  """Exit with status 2 and the usage on stderr (argparse's convention)."""
  print(f"{USAGE}\n\npython -m pallas_np: error: {message}", file=sys.stderr)
  raise SystemExit(2)


def parse(argv: list[str], version: str) -> Command:
  """The command of ``argv`` (what follows ``python -m pallas_np``).
  ``--help`` prints the usage to stdout and exits 0, ``--version`` prints
  the version and exits 0; a malformed line exits 2 with the usage on stderr."""
  argv = list(argv)
  options = {}
  report = False
  explain_dir = None
  while argv and argv[0].startswith("-") and argv[0] != "-m":
    flag = argv.pop(0)
    if flag in ("-h", "--help"):
      print(USAGE)
      raise SystemExit(0)
    if flag == "--version":
      print(f"pallas_np {version}")
      raise SystemExit(0)
    if flag == "--grid-report":
      report = True
    elif flag == "--explain":
      if not argv:
        usage_error("--explain needs an output directory")
      explain_dir = argv.pop(0)
    elif flag in PARAM_FLAGS:
      name, value = PARAM_FLAGS[flag]
      options[name] = value
    else:
      usage_error(f"unknown option {flag}")
  if not argv:
    usage_error("no program to run (a script.py or -m module)")
  if argv[0] == "-m" and len(argv) < 2:
    usage_error("-m needs a module name")
  return Command(options, report, explain_dir, argv)


def _module_run_by_python() -> str | None:
  """The module of ``python [options] -m MODULE ...`` (``sys.orig_argv``),
  else None."""
  args = getattr(sys, "orig_argv", [])[1:]
  i = 0
  while i < len(args):
    arg = args[i]
    if arg == "-m":
      return args[i + 1] if i + 1 < len(args) else None
    if arg.startswith("-m"):
      return arg[2:]
    if arg == "-c" or not arg.startswith("-"):  # a command or a script: not -m
      return None
    i += 2 if arg in ("-W", "-X", "--check-hash-based-pycs") else 1  # (their value)
  return None


def answer_without_jax(version: str) -> None:
  """Called by ``pallas_np/__init__`` before it imports JAX: when this
  process is ``python -m pallas_np ...`` (while a package runs under ``-m``,
  ``sys.argv[0]`` is ``"-m"``), parse its command line now, so that
  ``--help``, ``--version`` and usage errors exit without importing JAX. A
  valid command returns (``__main__`` parses it again to run it)."""
  if sys.argv[:1] == ["-m"] and _module_run_by_python() == "pallas_np":
    parse(sys.argv[1:], version)
