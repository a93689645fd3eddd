"""``plgpu.inline_mgpu``: Mosaic GPU IR written by hand inside a kernel.

Its body is Python that builds MLIR. Two kinds of body run here:
- PTX fences (``plgpu``'s ``inline_ptx`` of a ``fence.*`` instruction, as
  ``dynamic_scheduling_loop`` emits around its cluster-cancel buffers): they
  order a thread's memory accesses between the generic and asynchronous
  proxies, and here every access is visible in program order already (copies
  land at their barrier waits), so they change nothing a kernel can observe;
- bodies written with the parts of the Mosaic GPU Python API that
  ``pallas_np.mosaic_gpu.inline_values`` models (special registers such as
  the CUDA block index, scalar integer ``arith``, ``FragmentedArray`` splats,
  elementwise arithmetic and broadcasts, scalar ``memref`` loads/stores): the
  body runs once per warpgroup (or warp) with its module names (``mgpu``,
  ``ir``, ``gpu``/``arith``/``memref`` dialects) bound to NumPy stand-ins.

Anything else raises ``UnsupportedError`` naming the body, the construct it
used (or its PTX) and the kernel line."""
from __future__ import annotations

import inspect
import types

import jax
import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.mosaic_gpu import inline_values as iv
from pallas_np.mosaic_gpu import operands

def _ptx_of(fn) -> str | None:
  """The PTX an ``inline_ptx(asm)`` body inserts, or None."""
  if not getattr(fn, "__qualname__", "").startswith("inline_ptx."):
    return None
  try:
    asm = inspect.getclosurevars(fn).nonlocals.get("asm")
  except (TypeError, ValueError):  # pragma: no cover - not a Python function
    return None
  return asm if isinstance(asm, str) else None


def is_fence(fn) -> bool:
  asm = _ptx_of(fn)
  if asm is None:
    return False
  lines = [ln.strip() for ln in asm.strip().split(";") if ln.strip()]
  return bool(lines) and all(ln.startswith("fence.") for ln in lines)


def _module_kind(module) -> str | None:
  """Which stand-in replaces a module the body names (None: keep it)."""
  name = getattr(module, "__name__", "")
  if name in ("jax.experimental.mosaic.gpu", "jax._src.mosaic.gpu") or \
      name.startswith("jax.experimental.mosaic.gpu."):
    return "mgpu"
  if name.endswith("mlir.ir"):
    return "ir"
  for dialect in ("gpu", "arith", "memref"):
    if name.endswith(f"dialects.{dialect}"):
      return dialect
  if ".mlir" in name or "mosaic" in name:
    return "other"
  return None


def _with_stand_ins(fn, special):
  """``fn`` with its global module names bound to the NumPy stand-ins."""
  modules = {k: v for k, v in fn.__globals__.items() if isinstance(v, types.ModuleType)}
  kinds = {k: _module_kind(m) for k, m in modules.items()}
  stand_ins = iv.namespaces({kind: modules[k] for k, kind in kinds.items()
                             if kind not in (None, "other")}, special)
  env = dict(fn.__globals__)
  for k, kind in kinds.items():
    if kind == "other":
      env[k] = iv.Namespace(modules[k].__name__)
    elif kind is not None:
      env[k] = stand_ins[kind]
  for cell in fn.__closure__ or ():
    try:
      if isinstance(cell.cell_contents, types.ModuleType) and _module_kind(cell.cell_contents):
        raise iv.Refused(f"a module ({cell.cell_contents.__name__}) captured from an "
                         "enclosing function")
    except ValueError:  # an empty cell
      pass
  return types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__)


def _special(ctx):
  thread = ctx.family  # the plgpu.Mesh of the running kernel, and this thread's place
  if thread is None or thread.mesh is None:
    return None
  mesh, axes = thread.mesh, thread.mesh_axes
  grid_index = [int(axes[n]) for n in mesh.grid_names]
  cluster_index = [int(axes[n]) for n in mesh.cluster_names]
  return iv.Special(tuple(int(g) for g in mesh.grid), grid_index,
                    tuple(int(c) for c in mesh.cluster), cluster_index)


def _body_name(fn) -> str:
  return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def _arguments(e, args):
  """The body's arguments: Fragmented arrays for layout args, MemRefs
  (usable only untransformed) for ref args."""
  p = e.params
  arg_types = p["flat_arg_types"]
  n = len(arg_types)
  transforms = jc.tree_unflatten(p["pytree_ref_transforms"], list(args[n:]))
  flat = []
  for i, (value, ty, tr) in enumerate(zip(args[:n], arg_types, transforms)):
    if isinstance(e.in_avals[i], jc.AbstractRef):
      declared = tuple(getattr(ty, "transforms", ()) or ())
      plain = not tr and not declared
      tiling, swizzle = _layout(declared, i)
      flat.append(iv.MemRef(_indexed(value, tr, i), plain, f"ref argument {i}", tiling,
                            swizzle))
    else:
      flat.append(iv.Fragmented(np.asarray(value), ty))
  return jc.tree_unflatten(p["pytree_args"], flat)


def _layout(transforms, i):
  """(tiling, swizzle bytes) of a ref argument's declared transforms."""
  tiling, swizzle = (), None
  for t in transforms:
    if hasattr(t, "tiling"):
      tiling = tuple(int(x) for x in t.tiling)
    elif hasattr(t, "swizzle"):
      swizzle = int(t.swizzle)
    else:
      raise iv.Refused(f"ref argument {i}'s transform {t!r}")
  return tiling, swizzle


def _indexed(value, transforms, i):
  """The ref's logical view after the pallas-side indexers (``ref.at[...]``)."""
  view = value
  for t in transforms or ():
    if jc.is_layout_only_transform(t):  # the buffer is logical here: layout only
      continue
    if not isinstance(t, jc.NDIndexer):
      raise iv.Refused(f"ref argument {i} with the transform {type(t).__name__}")
    idx = []
    for ix in t.indices:
      if isinstance(ix, jc.Slice):
        start, size, stride = int(ix.start), int(ix.size), int(getattr(ix, "stride", 1))
        idx.append(slice(start, start + size * stride, stride))
      elif np.ndim(ix) == 0:
        idx.append(int(ix))
      else:
        raise iv.Refused(f"ref argument {i} indexed with an array")
    view = view[tuple(idx)]
  return view


def _results(e, ret):
  """The body's FragmentedArrays as the eqn's outputs, checked against
  the declared return types (as JAX's lowering does)."""
  p = e.params
  leaves, tree = jax.tree_util.tree_flatten(ret, is_leaf=lambda x: isinstance(x, iv.Fragmented))
  if tree != p["pytree_ret_ty"]:
    raise iv.Refused(f"a return value of structure {tree} (declared {p['pytree_ret_ty']})")
  outs = []
  for leaf, ty, aval in zip(leaves, p["flat_ret_ty"], e.out_avals):
    if not isinstance(leaf, iv.Fragmented):
      raise iv.Refused(f"a return value of type {type(leaf).__name__}")
    want = np.dtype(aval.dtype)
    got = leaf.array
    if tuple(got.shape) != tuple(aval.shape) or got.dtype.itemsize != want.itemsize or \
        (got.dtype.kind == "f") != (want.kind == "f"):
      raise iv.Refused(f"a return value of type {got.dtype}{list(got.shape)} where "
                       f"{want}{list(aval.shape)} is declared")
    outs.append(got.view(want) if got.dtype != want else got)
  return outs


if jc.mgpu_primitive("inline_mgpu_p") is not None:
  @registry.register(jc.mgpu_primitive("inline_mgpu_p"), needs_ctx=True, foldable=False,
                     batch=registry.unbatched("runs once per warpgroup"))
  def _inline_mgpu(e):
    fn = e.params["mgpu_fn"]
    if is_fence(fn) and not e.params.get("flat_ret_ty"):
      return lambda ctx, *args: []
    asm = _ptx_of(fn)
    if asm is not None:
      raise e.unsupported(f"inline_mgpu ({_body_name(fn)}: PTX {asm.strip()!r}): only PTX "
                          "fences can be interpreted")
    if not isinstance(fn, types.FunctionType):
      raise e.unsupported(f"inline_mgpu ({_body_name(fn)}): the body is not a Python function")

    array_returns = [tuple(r.shape) for r in e.params.get("flat_ret_ty") or () if r.shape]

    def inline_mgpu(ctx, *args):
      if array_returns and operands.in_warp(ctx):  # as JAX's lowering
        raise ValueError("inline_mgpu in a single-warp context only supports scalar return "
                         f"types. Got shape={array_returns[0]}.")
      try:
        body = _with_stand_ins(fn, _special(ctx))
        launch = iv.LaunchContext(operands.block_of(ctx), operands.thread_of(ctx))
        return _results(e, body(launch, *_arguments(e, args)))
      except iv.Refused as err:
        raise e.unsupported(f"inline_mgpu ({_body_name(fn)}) uses {err}, which the NumPy "
                            "stand-ins of the Mosaic GPU API do not model") from None
    return inline_mgpu
