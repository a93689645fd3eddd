"""What ``import pallas_np`` does to the process, checked in fresh
subprocesses: it leaves JAX's eager jit path as it is until a numpy-mode
kernel is traced (then the whole-program hooks are in, and run that kernel
with no XLA compilation), and it does not import JAX's Mosaic GPU modules
(about an ``import jax`` of import time) or Triton primitives, whose rules
register once user code imports them (``_compat.families``)."""
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(code: str) -> str:
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("PALLAS_NP_FORCE", None)
  out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  return out.stdout.strip().splitlines()[-1]


def test_import_leaves_jax_eager_jit_alone_until_a_numpy_kernel():
  out = _run("""
      import jax, jax.numpy as jnp
      from jax._src import pjit
      names = ("_pjit_call_impl_python", "_infer_params", "_run_python_pjit")
      before = [getattr(pjit, n) for n in names]
      import pallas_np
      from jax.experimental import pallas as pl
      jax.jit(lambda v: v + 1)(jnp.ones(8)).block_until_ready()
      untouched = [getattr(pjit, n) for n in names] == before
      def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2
      f = pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                         interpret="numpy")
      y = f(jnp.ones((8, 128), jnp.float32))
      hooked = all(getattr(pjit, n) is not b for n, b in zip(names, before))
      print(untouched, hooked, float(y[0, 0]))
      """)
  assert out == "True True 2.0", out


def test_eager_numpy_kernel_runs_without_xla_on_its_first_call():
  """Way 3 of docs/README.md, from a fresh process: the first eager call of
  a numpy-mode kernel is already routed (no XLA compile of the program)."""
  out = _run("""
      import jax, jax.numpy as jnp
      import pallas_np
      from jax._src import compiler
      from jax.experimental import pallas as pl
      x = jnp.ones((8, 128), jnp.float32).block_until_ready()
      compiled = []
      real = compiler.compile_or_get_cached
      def counting(*a, **k):
        compiled.append(1)
        return real(*a, **k)
      compiler.compile_or_get_cached = counting
      def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1
      f = pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                         interpret="numpy")
      y = f(x)
      print(len(compiled), float(y[0, 0]))
      """)
  assert out == "0 2.0", out


def test_import_does_not_import_mosaic_gpu_triton_or_scipy_special():
  out = _run("""
      import sys
      import pallas_np
      heavy = ("jax._src.pallas.mosaic_gpu.core", "jax._src.pallas.mosaic_gpu.primitives",
               "jax.experimental.mosaic.gpu", "pallas_np.mosaic_gpu.rules",
               "jax._src.pallas.triton.primitives",
               "scipy.special", "jax._src.lax_reference")  # ~0.5 s: on first use
      print([m for m in heavy if m in sys.modules])
      """)
  assert out == "[]", out
