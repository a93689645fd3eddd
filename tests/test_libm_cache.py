"""The compiled float loops' on-disk object cache and their loader
(pallas_np/primitives/libm_cache.py, libm_loader.py): a second process
loads the loops without importing LLVM and gets the same bits as LLVM's own
JIT; the off switch writes nothing; a damaged entry is recompiled, never
run; an object the loader does not handle falls back to the JIT."""
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pallas_np.primitives import libm, libm_cache, libm_loader
from tests.helpers import concurrently

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not libm_loader.available(),
                                reason="the object loader is Linux x86-64 only")

# Every loop once, over special values and a sweep of magnitudes; prints a
# digest of the result bits per loop, and whether LLVM was imported.
CHILD = r"""
import hashlib, json, sys
import numpy as np
from pallas_np.primitives import libm, libm_loader, xla_math
if sys.argv[1] == "mcjit":
  libm_loader.available = lambda: False
bits = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)
x = np.concatenate([bits.view(np.float32), np.float32([0, -0.0, np.inf, -np.inf, np.nan, 1e-45])])
y = np.roll(x, 7)
out = {}
for name in libm.names():
  args = (x, y)[:libm.address(name)[1]]
  out[name] = hashlib.sha256(libm.call(name, *args).tobytes()).hexdigest()
print(json.dumps({"digests": out, "llvm": "llvmlite.binding" in sys.modules}))
"""


def _child(tmp_path, mode="default", **env):
  env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path), **env)
  run = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
  assert run.returncode == 0, run.stderr
  return json.loads(run.stdout.strip().splitlines()[-1])


def _entries(tmp_path):
  return sorted((tmp_path / "pallas_np" / "libm").glob("*.o"))


def test_second_process_loads_without_llvm_and_same_bits(tmp_path):
  first = _child(tmp_path)
  assert first["llvm"]  # compiled: LLVM imported
  assert len(_entries(tmp_path)) == len(libm.names())
  second, jit = concurrently(  # (jit: LLVM's MCJIT for the host CPU)
      lambda: _child(tmp_path), lambda: _child(tmp_path / "unused", "mcjit"))
  assert not second["llvm"], "a warm cache must not import llvmlite.binding"
  assert second["digests"] == first["digests"]
  assert jit["digests"] == first["digests"]


def test_off_switch_writes_nothing(tmp_path):
  got = _child(tmp_path, PALLAS_NP_LIBM_CACHE="0")
  assert got["llvm"] and not _entries(tmp_path)


def test_damaged_entry_is_recompiled(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  key = "0" * 64
  libm_cache.write(key, b"\x7fELF-object-bytes")
  assert libm_cache.read(key) == b"\x7fELF-object-bytes"
  path = _entries(tmp_path)[0]
  data = bytearray(path.read_bytes())
  data[-1] ^= 1
  path.write_bytes(bytes(data))
  assert libm_cache.read(key) is None  # its digest no longer matches: not run
  monkeypatch.setenv("PALLAS_NP_LIBM_CACHE", "off")
  assert libm_cache.directory() is None and libm_cache.read(key) is None


def test_loader_refuses_what_it_does_not_handle():
  import llvmlite.binding as llvm
  llvm.initialize_native_target()
  llvm.initialize_native_asmprinter()
  ir, _ = libm._module_ir("sinf")
  # The small code model's PC-relative call (R_X86_64_PLT32): not loaded.
  machine = llvm.Target.from_triple("x86_64-unknown-linux-gnu").create_target_machine(
      cpu="x86-64", features="", opt=2, reloc="pic", codemodel="small")
  with pytest.raises(libm_loader.LoadError, match="relocation type"):
    libm_loader.load(machine.emit_object(llvm.parse_assembly(ir)))
  with pytest.raises(libm_loader.LoadError, match="ELF"):
    libm_loader.load(b"not an object")


def test_falls_back_to_the_jit_when_the_loader_refuses(monkeypatch):
  def refuse(obj):
    raise libm_loader.LoadError("refused (test)")
  monkeypatch.setattr(libm_loader, "load", refuse)
  monkeypatch.setattr(libm, "_engine", None)  # a JIT of its own, alive during the test
  monkeypatch.setattr(libm, "_addresses", {})  # the process's loops keep theirs
  x = np.linspace(-10, 10, 1001, dtype=np.float32)
  address = libm._build("cosf")  # not through the process's cached loops
  out = np.empty_like(x)
  address(x.ctypes.data, out.ctypes.data, x.size)
  np.testing.assert_array_equal(out.view(np.uint32), libm.call("cosf", x).view(np.uint32))


def test_address_is_a_c_loop():
  x = np.linspace(-5, 5, 257, dtype=np.float32)
  y = np.linspace(0.5, 3, 257, dtype=np.float32)
  address, nin = libm.address("powf")
  assert nin == 2
  loop = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_int64)(address)
  out = np.empty_like(x)
  loop(y.ctypes.data, x.ctypes.data, out.ctypes.data, x.size)
  np.testing.assert_array_equal(out.view(np.uint32), libm.call("powf", y, x).view(np.uint32))
  assert set(libm.names()) >= {"sinf", "cosf", "xla_expf", "xla_logf", "xla_tanhf"}
