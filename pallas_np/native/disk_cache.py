"""Where the native tier's compiled loops live on disk, and how one is
loaded (docs/native.md).

A compiled loop is a shared library (an extension module built by
``aot_worker``) named by the SHA-256 of everything that determines its
machine code: the generated source, its constants' bytes, the argument and
result types and ``FORMAT``. The directory is per Python ABI, machine and
numba version, so a library is only ever loaded by the interpreter it was
built for:

  ``$PALLAS_NP_NATIVE_CACHE`` if set (``off``/``0``/``none``: nothing is
  kept, the libraries of this process go to a temporary directory removed
  at exit), else ``$XDG_CACHE_HOME/pallas_np/native`` or
  ``~/.cache/pallas_np/native``; then ``<python tag>-<machine>-<CPU id>-numba<version>``
  (libraries are built for the host CPU).

Loading a library costs a ``dlopen`` (under a millisecond) and needs
neither numba nor a compile: a second process (a re-run test suite) runs a
loop natively from its first hot call. Delete the directory to clear it.
"""
from __future__ import annotations

import atexit
import glob
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile

import numpy as np

from pallas_np.native.aot_worker import MODULE

ENV = "PALLAS_NP_NATIVE_CACHE"
OFF_VALUES = ("off", "0", "none", "false", "no")
# Bumped whenever the generated code's calling convention changes.
FORMAT = 2

_dir: list = []


def _numba_version() -> str:
  """numba's version without importing it (its import costs ~0.5-1 s;
  ``importlib.metadata`` ~0.2 s): the name of its dist-info directory."""
  spec = importlib.util.find_spec("numba")
  if spec is None or not spec.origin:
    return "none"
  site = os.path.dirname(os.path.dirname(spec.origin))
  found = sorted(glob.glob(os.path.join(site, "numba-*.dist-info")))
  if found:
    return os.path.basename(found[-1])[len("numba-"):-len(".dist-info")]
  return str(int(os.stat(spec.origin).st_mtime))


def _cpu() -> str:
  """A short id of this CPU's model and features: libraries are built for
  the host CPU (its vector instructions), so a cache directory shared by
  machines (a network home) keeps one set per CPU. ``platform.processor()``
  only where /proc/cpuinfo cannot be read: on Linux it runs ``uname -p`` in
  a subprocess, 2-5 ms of a kernel's first call."""
  try:
    with open("/proc/cpuinfo") as f:
      info = f.read(1 << 16)
    text = "\n".join(l for l in info.splitlines()
                     if l.startswith(("model name", "flags", "Features", "CPU part")))[:8192]
  except OSError:
    text = platform.processor()
  return hashlib.sha256(text.encode()).hexdigest()[:8]


def enabled() -> bool:
  """Whether compiled loops persist across processes."""
  return os.environ.get(ENV, "").strip().lower() not in OFF_VALUES


def _root() -> str:
  """The directory holding one cache directory per Python, CPU and numba."""
  return os.environ.get(ENV, "").strip() or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
      "pallas_np", "native")


def directory() -> str:
  """The directory this process's libraries are written to and read from
  (created on first use)."""
  if _dir:
    return _dir[0]
  if enabled():
    root = _root()
    tag = (f"{sys.implementation.cache_tag}-{platform.machine()}-{_cpu()}"
           f"-numba{_numba_version()}")
    path = os.path.join(root, tag)
    os.makedirs(path, exist_ok=True)
  else:
    path = tempfile.mkdtemp(prefix="pallas_np-native-")
    atexit.register(shutil.rmtree, path, True)
  _dir.append(path)
  return path


def key(text: str, constants: dict, args, ret, externals=None) -> str:
  """The library's name: a hash of what its machine code depends on (the
  IR of the functions it links in included)."""
  h = hashlib.sha256()
  h.update(f"{FORMAT}\n{text}\n{args!r}\n{ret!r}\n{sorted((externals or {}).items())!r}\n"
           .encode())
  for name in sorted(constants):
    v = np.asarray(constants[name])
    h.update(f"{name}:{v.dtype.str}:{v.shape}:".encode())
    h.update(v.tobytes())
  return h.hexdigest()[:40]


def loop_key(src, args, ret, avals) -> str:
  """A loop library's key: ``key`` of its source (``codegen.Source``),
  signature and the operands' shapes (``avals``): lite compiles a ref's
  static shape in (``lite_cache.arg_descs``), so one source run on refs of
  another shape needs a library of its own."""
  shapes = [list(getattr(a, "inner_aval", a).shape) for a in avals]
  return key(src.text, src.globals, [args, shapes], ret, src.externals)


def library_path(k: str) -> str:
  return os.path.join(directory(), f"{k}.so")


def write_job(k: str, text: str, constants: dict) -> tuple[str, str]:
  """The source and constants a build reads (kept beside the library: the
  source is what one reads to see what a loop compiled to)."""
  src = os.path.join(directory(), f"{k}.py")
  consts = os.path.join(directory(), f"{k}.npz")
  for path, write in ((src, lambda f: f.write(text.encode())),
                      (consts, lambda f: np.savez(f, **{n: np.asarray(v)
                                                         for n, v in constants.items()}))):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
      write(f)
    os.replace(tmp, path)
  return src, consts


def _prekey_dir() -> str:
  return os.path.join(directory(), "pre")


def has_prekeys() -> bool:
  """Whether any loop's pre-key was recorded here (none on a new machine:
  a first run then skips computing pre-keys). Asked at a kernel's first
  run: where the cache root holds nothing yet, answered without this
  process's directory (its tag reads /proc/cpuinfo and lists
  site-packages, ~0.8 ms of a first call)."""
  if not _dir and enabled():
    try:
      with os.scandir(_root()) as it:
        if not any(True for _ in it):
          return False
    except OSError:
      return False
  try:
    with os.scandir(_prekey_dir()) as it:
      return any(True for _ in it)
  except OSError:
    return False


def read_prekey(pk: str) -> dict | None:
  """What ``write_prekey`` recorded for the pre-key ``pk`` (``prekey.py``):
  the library's key and the loop's signature, or None."""
  try:
    with open(os.path.join(_prekey_dir(), f"{pk}.json")) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def write_prekey(pk: str, record: dict) -> None:
  """Records the library key and signature a loop's pre-key generated."""
  d = _prekey_dir()
  os.makedirs(d, exist_ok=True)
  path = os.path.join(d, f"{pk}.json")
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(record, f)
  os.replace(tmp, path)


def load(path: str):
  """The ``native_loop`` function of the library at ``path``, or None if
  there is none (loaded under its path: every library has the module name
  ``MODULE``, and none goes into ``sys.modules``)."""
  if not os.path.exists(path):
    return None
  loader = importlib.machinery.ExtensionFileLoader(MODULE, path)
  spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
  try:
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
  except ImportError as e:  # (a broken library: built again under a new name, never used)
    raise LoadError(f"{path}: {e}") from e
  return module.native_loop


class LoadError(Exception):
  """A library on disk could not be loaded."""
