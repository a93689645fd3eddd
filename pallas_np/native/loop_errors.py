"""A compiled loop's errors, raised as the NumPy path raises them: under
frames whose source-map lines name the eqn that failed and the control
flow around it (``compiler.sourcemap``), so the traceback and the
``UnsupportedError``/``IndexError`` text point at the kernel's line as the
NumPy path's plans do. Used by the loop tier (a bounds-check site's error,
``tier.NativeLoop``) and by DMA call sites (``dma_calls``)."""
from __future__ import annotations

from pallas_np.compiler import sourcemap
from pallas_np.native import codegen, disk_cache


def _frame(eqn, inner):
  """A call of ``inner`` in a frame whose line maps to ``eqn``."""
  filename = sourcemap.new_filename("native loop")
  scope = {"_line_eqns": sourcemap.register(filename, [None, eqn])}
  exec(compile("def _at(inner):\n    return inner()\n", filename, "exec"), scope)  # noqa: S102
  at = scope["_at"]
  return lambda: at(inner)


def call_under(chain, eqn, fn):
  """``fn()`` (which raises) under frames naming ``chain``'s eqns, then ``eqn``."""
  for e in reversed((*chain, eqn)):
    fn = _frame(e, fn)
  fn()


def regenerated(loop):
  """The source of a loop loaded by its pre-key (no source kept: its
  sites and call sites are generated on the error path), checked to be the
  one its library was built from."""
  src = codegen.loop_source(loop.eqn, loop.clamp, loop.uninitialized)
  job = loop.job
  if disk_cache.loop_key(src, job["args"], job["ret"], loop.invars) != job["key"]:
    raise RuntimeError("pallas_np: a native loop's pre-key named another source")
  return src


def raise_oob(loop, st, args):
  """The NumPy rule's error for the bounds-check site the status array
  ``st`` names (its index in ``st[0]``, its dynamic indices after it),
  raised by the rule itself on the operands ``args``."""
  if loop.sites is None:  # (loaded by its pre-key)
    loop.sites = regenerated(loop).sites
  eqn, access, pos, chain = loop.sites[int(st[0]) - 1]
  leaves = [int(v) for v in st[1:1 + access.num_dynamic]]
  ref = args[pos]

  def resolve():
    access.resolve(ref, leaves)
    raise RuntimeError("pallas_np: native loop bounds check disagrees with the NumPy rule")
  call_under(chain, eqn, resolve)
