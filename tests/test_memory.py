"""Memory stays flat however many distinct kernels a program compiles: the
caches of compiled plans are bounded LRUs, a plan's source map entry (and
its linecache source) goes when the plan is collected, and
``pallas_np.clear_caches()`` empties them all."""
import gc
import linecache

import jax
import jax.numpy as jnp
import numpy as np

import pallas_np
from pallas_np import api, lru
from pallas_np.compiler import Compiler, sourcemap


def _our_linecache_entries() -> int:
  return sum(1 for f in list(linecache.cache) if f.startswith("<pallas_np plan "))


def _add_kernel(c):
  return pallas_np.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + c),
                               out_shape=jax.ShapeDtypeStruct((8,), jnp.float32))


def test_thousands_of_distinct_kernels_leave_bounded_state():
  x = np.zeros(8, np.float32)
  pallas_np.clear_caches()
  gc.collect()
  assert sourcemap.size() == 0
  np.testing.assert_array_equal(np.asarray(_add_kernel(0.5)(x)), x + 0.5)
  per_kernel = sourcemap.size()  # the eager plan, the kernel, its index maps
  assert per_kernel >= 2
  first = api._plan_cache.values()[-1][1]
  first_files = [first.kernel.filename] + [m.filename for m in first.index_maps]
  del first
  n = 3 * api.PLAN_CACHE_SIZE
  for i in range(1, n):  # distinct kernels: each adds its own constant
    out = _add_kernel(float(i))(x)
  np.testing.assert_array_equal(np.asarray(out), x + float(n - 1))
  assert len(api._plan_cache) <= api.PLAN_CACHE_SIZE
  assert len(api._eager_cache) <= api.PLAN_CACHE_SIZE
  gc.collect()
  # Entries of evicted plans are gone with them (not n * per_kernel).
  bound = 2 * api.PLAN_CACHE_SIZE * per_kernel
  assert sourcemap.size() <= bound, (sourcemap.size(), bound)
  assert _our_linecache_entries() <= sourcemap.size()
  assert all(sourcemap.lookup(f) is None for f in first_files)
  assert all(f not in linecache.cache for f in first_files)

  # Plans compiled straight through the Compiler and dropped leave nothing.
  jaxprs = [jax.make_jaxpr(lambda v, k=k: jnp.sin(v) * float(k) + 1.0)(jnp.zeros(4))
            for k in range(30)]
  before = sourcemap.size()
  for i in range(3000):
    plan = Compiler(name=f"k{i}").compile(jaxprs[i % len(jaxprs)], first_calls=bool(i % 2))
    plan(None, np.ones(4, np.float32))
  del plan
  gc.collect()
  assert sourcemap.size() == before

  pallas_np.clear_caches()
  assert sourcemap.size() == 0
  assert _our_linecache_entries() == 0
  assert len(api._plan_cache) == len(api._eager_cache) == 0


def test_source_entry_lives_with_the_plan_and_its_code():
  jaxpr = jax.make_jaxpr(lambda v: jnp.cos(v) + 2.0)(jnp.zeros(3))
  plan = Compiler(name="lifecycle").compile(jaxpr)
  filename = plan.filename
  eqns = sourcemap.lookup(filename)
  assert eqns is not None and any(e is not None and e.primitive.name == "cos" for e in eqns)
  assert filename in linecache.cache
  # A rule may keep only the generated function (a reduction's combine):
  # its frames still name their eqns.
  fn = plan.fn
  del plan
  gc.collect()
  assert sourcemap.lookup(filename) is eqns
  del fn, eqns
  gc.collect()
  assert sourcemap.lookup(filename) is None
  assert filename not in linecache.cache


def test_plan_evicted_from_its_cache_takes_its_entry():
  x = np.zeros(8, np.float32)
  _add_kernel(-1.0)(x)
  kp = api._plan_cache.values()[-1][1]
  filename = kp.kernel.filename
  assert sourcemap.lookup(filename) is not None
  del kp
  for i in range(api.PLAN_CACHE_SIZE + 1):
    _add_kernel(-2.0 - i)(x)
  gc.collect()
  assert sourcemap.lookup(filename) is None


def test_lru():
  cache = lru.LRU(3)
  for k in "abc":
    cache.put(k, k.upper())
  assert cache.get("a") == "A"  # now the most recently used
  cache.put("d", "D")  # evicts b, the least recently used
  assert "b" not in cache and cache.get("b") is None and len(cache) == 3
  assert cache.values() == ["C", "A", "D"]
  assert cache.setdefault("c", "other") == "C"
  assert cache.setdefault("e", "E") == "E" and "a" not in cache
  other = lru.LRU(2)
  other.put(1, 1)
  lru.clear_all()
  assert len(cache) == len(other) == 0
