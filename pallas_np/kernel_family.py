"""The one way a kind of kernel eqn (a *kernel family*) plugs into pallas_np:
lower → plan → run.

A family (``KernelFamily``) names its primitives and turns one eqn's params
into a compiled *kernel* (``plan``, cached by the family), an object with

* ``name``, ``out_avals``;
* ``compile()``: compile everything now (the traced path calls it at
  lowering time, so an unsupported primitive raises from the ``jax.jit``
  call, not from inside a callback);
* ``device_features``: (axis names it reads with ``axis_index``, whether it
  talks to other devices): inside a ``shard_map``/``pmap`` body such a
  kernel runs one instance per device (``lowering.lower_kernel``);
* ``run(*numpy_operands, placement=None) -> list of numpy outputs``.

Everything else is the same for every family and lives here: the numpy-mode
lowering rule put in front of JAX's (``lowering_rule``/``lower``: one
``io_callback`` into ``kernel.run``), and the eager evaluator's rule
(``register_family`` registers it in ``registry``: ``pallas_np.jit``,
``whole_program``). Families today: ``pallas_call`` (``api``: a
``grid.KernelPlan``), mesh kernels (``meshes``: a ``MeshKernel`` whose runner
is chosen by mesh type: TPU cores and SparseCore subcores, Mosaic GPU
blocks; ``plgpu.warp_map`` inside a Mosaic GPU kernel is an ``inner_rule``).
Multi-device kernels are any family's kernels with device features.
"""
from __future__ import annotations

import functools

from pallas_np import _compat as jc
from pallas_np import lowering, registry
from pallas_np.params import InterpretParams, is_numpy_mode, resolve


class KernelFamily:
  """One kind of kernel eqn. Subclass, set ``primitives`` (and
  ``sequential_reason``: why an outer grid around it runs sequentially),
  implement ``plan``; then ``register_family(family)`` and install its
  lowering (``lowering_rule``; ``api.install`` does it for the families
  pallas_np has)."""
  name = "kernel"
  primitives: tuple = ()
  sequential_reason = "a kernel runs its own grid: the outer grid runs sequentially"

  def plan(self, prim, params: dict, num_inputs: int, interp: InterpretParams,
           call_site: str = ""):
    """The compiled kernel of one eqn's params (cached by the family);
    raises ``UnsupportedError`` naming the construct and kernel line for
    what it cannot run."""
    raise NotImplementedError

  def inner_rule(self, e: registry.EqnInfo):
    """The evaluator's rule of an eqn of these primitives that is not a
    kernel of its own but a construct inside one (``plgpu.warp_map``),
    else None."""
    return None

  def check_eager(self, e: registry.EqnInfo) -> None:
    """Raise for an eqn the eager evaluator must not run as a kernel."""


# -- the traced path --------------------------------------------------------------------
def lower(family: KernelFamily, prim, jax_rule, ctx, in_nodes, params: dict):
  """The lowering of one ``prim`` eqn of ``family``: JAX's own rule
  (``jax_rule``) unless it is in numpy mode; then the kernel, compiled now,
  called through one unordered ``io_callback`` (one per device inside
  ``shard_map`` for a kernel with device features)."""
  # JAX reads the force config when a kernel is built; reading it again here
  # also routes kernels built outside the scope (a module-level
  # ``pl.pallas_call``) but lowered inside it. As in JAX, the config wins.
  forced = jc.interpret_mode_config.value
  interpret = forced if is_numpy_mode(forced) else params.get("interpret")
  if not is_numpy_mode(interpret):
    return jax_rule(ctx, *in_nodes, **params)
  kernel = family.plan(prim, dict(params, interpret=interpret), len(in_nodes),
                       resolve(interpret), jc.lowering_source(ctx))
  kernel.compile()
  names, remote = kernel.device_features
  return lowering.lower_kernel(ctx, in_nodes, kernel, names, remote)


def lowering_rule(family: KernelFamily, prim, jax_rule):
  """The numpy-mode lowering rule of ``prim``, in front of ``jax_rule``."""
  def rule(ctx, *in_nodes, **params):
    return lower(family, prim, jax_rule, ctx, in_nodes, params)
  rule.pallas_np_family = family
  return rule


# -- the eager path ---------------------------------------------------------------------
_families: dict = {}  # primitive -> its KernelFamily


def family_of(prim) -> KernelFamily | None:
  """The registered family whose kernels ``prim`` eqns are, else None."""
  return _families.get(prim)


def kernel_primitives() -> tuple:
  """The primitives of every registered kernel family."""
  return tuple(_families)


def register_family(family: KernelFamily) -> KernelFamily:
  """Register the eager evaluator's rule of each of ``family``'s primitives
  (those this JAX has)."""
  for prim in family.primitives:
    if prim is not None:
      _families[prim] = family
      registry.register(prim, foldable=False, batch=registry.unbatched(
          family.sequential_reason))(functools.partial(eager_rule, family))
  return family


def eager_rule(family: KernelFamily, e: registry.EqnInfo):
  """The evaluator's rule of one eqn of ``family``: the kernel's ``run``."""
  rule = family.inner_rule(e)
  if rule is not None:
    return rule
  family.check_eager(e)
  # Only the eager paths evaluate outer jaxprs; their compiler carries the
  # options the call resolved (explicit, forced or default), or says that
  # each kernel keeps its own.
  interp = e.compiler.params
  if e.compiler.kernel_params_from_eqns:
    interp = resolve(e.params["interpret"])
  return family.plan(e.primitive, dict(e.params), len(e.in_avals), interp, e.source).run
