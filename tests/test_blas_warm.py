"""The BLAS buffer warm-up (``pallas_np/blas.py`` ``_warm_buffer``): one
float32 GEMM on one thread at the process's first kernel run, and never
again, in no thread; the products before and after it are the same bits
(the same OpenBLAS code on the same data: only its speed changes). Run in
a fresh process, where no GEMM has warmed the buffer yet."""
import os
import subprocess
import sys

import pytest

from pallas_np import blas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import threading
import numpy as np
from pallas_np import blas

rng = np.random.default_rng(0)
pairs = [(rng.standard_normal((m, k)).astype(np.float32),
          rng.standard_normal((k, n)).astype(np.float32))
         for m, k, n in ((128, 128, 128), (16, 64, 128), (16, 128, 64), (40, 96, 200))]
one = blas.matmul_for(1)  # (one BLAS thread, as in a kernel run)
before = [one(x, y) for x, y in pairs]
calls = []
real = blas._warm_buffer
blas._warm_buffer = lambda: (calls.append(threading.get_ident()), real())
with blas.kernel_run():
  after = [np.matmul(x, y) for x, y in pairs]
with blas.kernel_run():
  pass
t = threading.Thread(target=lambda: blas.kernel_run().__enter__() or blas.kernel_run().__exit__())
t.start()
t.join()
assert calls == [threading.get_ident()], calls
for b, a in zip(before, after):
  assert np.array_equal(b.view(np.uint32), a.view(np.uint32))
print("ok")
"""


@pytest.mark.skipif(blas._set is None, reason="NumPy's BLAS is not an OpenBLAS found here")
def test_warm_up_once_per_process_same_bits():
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  env.pop("PALLAS_NP_BLAS_WARM", None)
  out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
