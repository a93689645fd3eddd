"""Explicit MXU programming (``pltpu.matmul_push_rhs``, ``matmul_acc_lhs``,
``matmul_pop``, ``matmul_lhs_fifo``, ``matmul_pop_fifo``; JAX >= 0.12).

Each MXU of the program (per core, in ``RunContext.rules.mxu``) has staging
registers a RHS is pushed to, the RHS it currently holds, and a result FIFO; accumulators (``pltpu.ACC``
scratch) start at zero.
Float operands multiply in float32, integers in int32, as the MXU
accumulates. What the hardware calls an error raises here: pushing to a
staging register that was not loaded since, loading an empty one, a matmul
with no RHS, popping an empty FIFO or a result of another shape.
"""
from __future__ import annotations

import collections

import jax
import numpy as np

from pallas_np import _compat as jc
from pallas_np import registry
from pallas_np.dtypes import np_dtype
from pallas_np.kernel_context import rule_state
from pallas_np.primitives.tpu_operands import operand_positions, ref_operand

mp = jc.mosaic_primitives
_SEQUENTIAL = registry.unbatched("MXU state is per core and in program order: "
                                 "the grid runs sequentially")


class MxuState:
  __slots__ = ("staged", "rhs", "fifo", "accumulators")

  def __init__(self):
    self.staged: dict = {}  # (mxu, register) -> rhs
    self.rhs: dict = {}  # mxu -> the rhs it holds
    self.fifo = collections.defaultdict(collections.deque)  # mxu -> results
    self.accumulators: set = set()  # addresses of accumulator buffers zeroed this run


def _accumulator(st, buf):
  """An accumulator starts at zero (a kernel must leave it so), not with the
  uninitialized fill of scratch: zero it at its first use in a run."""
  key = buf.__array_interface__["data"][0]
  if key not in st.accumulators:
    st.accumulators.add(key)
    buf[...] = 0


def _state(ctx) -> MxuState:
  rules = rule_state(ctx)
  st = rules.mxu
  if st is None:
    st = rules.mxu = MxuState()
  return st


def _acc_dtype(dtype) -> np.dtype:
  return np.dtype(np.int32) if np.issubdtype(np_dtype(dtype), np.integer) else \
      np.dtype(np.float32)


def _load(st, mxu, register, what):
  if register is None:
    return
  rhs = st.staged.pop((mxu, register), None)
  if rhs is None:
    raise RuntimeError(f"{what}: staging register {register} of MXU {mxu} is empty "
                       "(matmul_push_rhs to it first)")
  st.rhs[mxu] = rhs


def _product(st, mxu, lhs, what):
  rhs = st.rhs.get(mxu)
  if rhs is None:
    raise RuntimeError(f"{what}: MXU {mxu} holds no RHS (load one with load_staged_rhs=)")
  dt = _acc_dtype(lhs.dtype)
  return np.matmul(np.asarray(lhs, dt), np.asarray(rhs, dt))


def _acc_operand(e, n_fixed, tree_param):
  """(fn(args) -> (view, idx)) of the accumulator ref (invar 0) with its
  transforms, and its MXU (from the ref's AccMemorySpace)."""
  n = len(e.eqn.invars)
  positions = operand_positions(e, jax.tree_util.tree_structure(list(range(n))))
  transforms = jc.tree_unflatten(e.params[tree_param], positions[n_fixed:])
  space = jc.memory_space_of(e.in_avals[0])
  space = getattr(space, "memory_space", space)  # CoreMemorySpace(acc, mesh)
  mxu = getattr(space, "mxu_id", None)
  if mxu is None:
    raise e.unsupported("an MXU accumulator whose MXU is unknown")
  return ref_operand(e, positions[0], transforms), int(mxu)


if getattr(mp, "matmul_push_rhs_p", None) is not None:
  @registry.register(mp.matmul_push_rhs_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
  def _push_rhs(e):
    reg, mxu = int(e.params["staging_register"]), int(e.params["mxu_index"])
    transpose = bool(e.params.get("transpose", False))
    what = f"matmul_push_rhs at {e.source}"

    def push(ctx, rhs):
      st = _state(ctx)
      if (mxu, reg) in st.staged:
        raise RuntimeError(f"{what}: staging register {reg} of MXU {mxu} already holds a "
                           "RHS that was never loaded")
      st.staged[(mxu, reg)] = np.array(rhs.T if transpose else rhs)
      return []
    return push

if getattr(mp, "matmul_acc_lhs_p", None) is not None:
  @registry.register(mp.matmul_acc_lhs_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
  def _acc_lhs(e):
    get_acc, mxu = _acc_operand(e, 2, "acc_transforms_tree")
    register = e.params.get("load_staged_rhs")
    what = f"matmul_acc_lhs at {e.source}"

    def acc_lhs(ctx, *args):
      st = _state(ctx)
      _load(st, mxu, register, what)
      _accumulator(st, args[0])
      view, idx = get_acc(args)
      view[idx] += _product(st, mxu, args[1], what).astype(view.dtype)
      return []
    return acc_lhs

if getattr(mp, "matmul_pop_p", None) is not None:
  @registry.register(mp.matmul_pop_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
  def _pop(e):
    get_acc, _ = _acc_operand(e, 1, "acc_transforms_tree")

    def pop(ctx, *args):
      _accumulator(_state(ctx), args[0])
      view, idx = get_acc(args)
      out = np.array(view[idx])
      view[idx] = 0
      return out
    return pop

if getattr(mp, "matmul_lhs_fifo_p", None) is not None:
  @registry.register(mp.matmul_lhs_fifo_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
  def _lhs_fifo(e):
    mxu = int(e.params["mxu_index"])
    register = e.params.get("load_staged_rhs")
    what = f"matmul_lhs_fifo at {e.source}"

    def lhs_fifo(ctx, lhs):
      st = _state(ctx)
      _load(st, mxu, register, what)
      st.fifo[mxu].append(_product(st, mxu, lhs, what))
      return []
    return lhs_fifo

if getattr(mp, "matmul_pop_fifo_p", None) is not None:
  @registry.register(mp.matmul_pop_fifo_p, needs_ctx=True, foldable=False, batch=_SEQUENTIAL)
  def _pop_fifo(e):
    mxu = int(e.params["mxu_index"])
    shape = tuple(e.params["shape"])
    dt = np_dtype(e.params["dtype"])
    what = f"matmul_pop_fifo at {e.source}"

    def pop_fifo(ctx):
      fifo = _state(ctx).fifo[mxu]
      if not fifo:
        raise RuntimeError(f"{what}: the result FIFO of MXU {mxu} is empty (a hardware error)")
      res = fifo.popleft()
      if res.shape != shape:
        raise ValueError(f"{what}: pops a {shape} result, but the next one in the FIFO of "
                         f"MXU {mxu} is {res.shape}")
      return res.astype(dt)
    return pop_fifo
