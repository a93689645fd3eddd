"""A compiled DMA queue for the local DMAs of a compiled loop
(docs/native_dma.md): ``dma_start`` and ``dma_wait`` call sites of the
simplest, commonest form run in machine code with the NumPy path's
semantics (``state/dma.py``), every other case calls back into its NumPy
rule (``dma_calls``).

The queue is the loop function's own int64 array ``_dq`` (a row per DMA
started and not yet waited for, oldest first). A compiled start checks
its indices (all in bounds, else the callback: the NumPy rule raises its
own error or clamps), records the source's and destination's byte
addresses, shape and strides, its semaphore's address and its scalar
operands. A compiled wait pops the oldest rows on its semaphore's address
while the count is too low, each copying its source, read *now*, into its
destination and adding its bytes to the semaphore, then decrements it:
the NumPy rule's loop (``dma.wait``). Nothing a wait cannot satisfy is
decided here: the callback raises the deadlock error.

Exactness with the NumPy path's queue: the compiled rows are always the
newest DMAs. Before any callback (any NumPy DMA or semaphore rule) the
rows still queued are *flushed*: started on the NumPy path, in order, by
their own site's rule with their recorded operands (the same grid point,
the same source), so the NumPy queue is then the whole queue; the loop's
exit flushes too. The status slot ``MODE`` says what the compiled code may
do (``dma_calls`` sets it at entry and after every callback): 0 — the
NumPy queue is empty, starts and waits compiled; 1 — it holds DMAs, starts
compiled, waits call back (they must pop the older DMAs first); 2 —
everything calls back (a multi-device run or a race detector: they take
locks and record accesses; an operand that is read-only).
"""
from __future__ import annotations

import jax
import numpy as np

from pallas_np import _compat as jc
from pallas_np.native import blas_calls
from pallas_np.primitives.tpu_operands import OperandPos
from pallas_np.state import indexing
from pallas_np.state.indexing import RefAccess

OPERANDS = blas_calls.PYCALL + 1  # (dma_calls.OPERANDS)
# Status slots after the callback's operands (``blas_calls.PYCALL_EXTRA``):
# what the compiled queue may do (0: on, 2: off for this call), the start
# order of the DMA a callback starts (-1: none), the queue's address, the
# owner number of this loop call and of the row a callback flushes, and
# the semaphores the NumPy queue holds DMAs on (their count;
# ``PENDING_MAX`` + 1: more than fit, every wait calls back).
MODE = OPERANDS + blas_calls.PYCALL_OPERANDS
ORDER, QADDR, OWNER, CALL_OWNER = MODE + 1, MODE + 2, MODE + 3, MODE + 4
PENDING_N = MODE + 5
PENDING = PENDING_N + 1
PENDING_MAX = blas_calls.PYCALL_EXTRA - (PENDING - MODE)
CAPACITY = 64  # rows; a start finding the queue full calls back (after a flush)
RANK = 4  # the most dims a compiled DMA window has
# Row 0 of the queue: head, tail, the next start order. Then a row per
# DMA: site, semaphore address, source and destination byte addresses,
# item size, start order, owner (the loop call whose operands it names:
# ``dma_stash``), shape (RANK), source strides, destination strides
# (bytes; leading dims padded with 1s), the site's scalar operands.
SITE, SEM, SRC, DST, ITEM, SEQ, OWN, SHAPE = 0, 1, 2, 3, 4, 5, 6, 7
SSTR, DSTR = SHAPE + RANK, SHAPE + 2 * RANK
SCALARS = SHAPE + 3 * RANK
WIDTH = SCALARS + blas_calls.PYCALL_OPERANDS
ALL, NONE = -1, -2  # a callback's flush: every row, no row


def _item_pointers():
  """Header lines: ``_p8`` .. ``_p64``, an integer address as a pointer to
  items of that many bits (``ptr[i]`` loads and stores them)."""
  lines = []
  for b in (8, 16, 32, 64):
    lines += [f"def _t_p{b}(typingctx, addr):",
              "    def codegen(context, builder, sig, llargs):",
              f"        return builder.inttoptr(llargs[0], _lir.IntType({b}).as_pointer())",
              f"    return _nt.CPointer(_nt.int{b})(_nt.int64), codegen",
              f"_p{b} = _intrinsic(_t_p{b})", ""]
  return lines


HEADER = "\n".join([
    "from numba import njit as _njit",
    "from numba import carray as _carray",
    "from numba.core import cgutils as _cgutils",
    "",
    "def _t_ld64(typingctx, addr):",
    "    def codegen(context, builder, sig, llargs):",
    "        p = builder.inttoptr(llargs[0], _lir.IntType(64).as_pointer())",
    "        return builder.load(p)",
    "    return _nt.int64(_nt.int64), codegen",
    "_ld64 = _intrinsic(_t_ld64)",
    "",
    "def _t_st64(typingctx, addr, v):",
    "    def codegen(context, builder, sig, llargs):",
    "        p = builder.inttoptr(llargs[0], _lir.IntType(64).as_pointer())",
    "        builder.store(llargs[1], p)",
    "        return context.get_dummy_value()",
    "    return _nt.void(_nt.int64, _nt.int64), codegen",
    "_st64 = _intrinsic(_t_st64)",
    "",
    "def _t_mcpy(typingctx, dst, src, n):",
    "    def codegen(context, builder, sig, llargs):",
    "        i8p = _lir.IntType(8).as_pointer()",
    "        _cgutils.raw_memcpy(builder, builder.inttoptr(llargs[0], i8p),",
    "                            builder.inttoptr(llargs[1], i8p), llargs[2], 1)",
    "        return context.get_dummy_value()",
    "    return _nt.void(_nt.int64, _nt.int64, _nt.int64), codegen",
    "_mcpy = _intrinsic(_t_mcpy)",
    "",
    "def _t_qptr(typingctx, addr):",
    "    def codegen(context, builder, sig, llargs):",
    "        return builder.inttoptr(llargs[0], _lir.IntType(64).as_pointer())",
    "    return _nt.CPointer(_nt.int64)(_nt.int64), codegen",
    "_qptr = _intrinsic(_t_qptr)",
    "",
    *_item_pointers(),
    "@_njit",
    "def _dq_run(dst, ds, src, ss, n, isz):",
    # n items of isz bytes, ``src`` + e * ss -> ``dst`` + e * ds: one memcpy
    # where both are contiguous, a typed load and store per item where the
    # item size divides the strides (a stride 0 source: a broadcast), else
    # a memcpy per item
    "    if ds == isz and ss == isz:",
    "        _mcpy(dst, src, n * isz)",
    "    elif isz == 4 and ds % 4 == 0 and ss % 4 == 0:",
    "        _dq_items(_p32(dst), ds // 4, _p32(src), ss // 4, n)",
    "    elif isz == 8 and ds % 8 == 0 and ss % 8 == 0:",
    "        _dq_items(_p64(dst), ds // 8, _p64(src), ss // 8, n)",
    "    elif isz == 2 and ds % 2 == 0 and ss % 2 == 0:",
    "        _dq_items(_p16(dst), ds // 2, _p16(src), ss // 2, n)",
    "    elif isz == 1:",
    "        _dq_items(_p8(dst), ds, _p8(src), ss, n)",
    "    else:",
    "        for e in range(n):",
    "            _mcpy(dst + e * ds, src + e * ss, isz)",
    "",
    "@_njit",
    "def _dq_items(d, dq, s, sq, n):",
    # (item pointers and strides in items; the common forms first, so that
    # LLVM sees unit strides and vectorizes)
    "    if dq == 1 and sq == 0:",
    "        v = s[0]",
    "        for e in range(n):",
    "            d[e] = v",
    "    elif dq == 1:",
    "        for e in range(n):",
    "            d[e] = s[e * sq]",
    "    else:",
    "        for e in range(n):",
    "            d[e * dq] = s[e * sq]",
    "",
    "@_njit",
    "def _dq_strided(base, row, strides, out, gather):",
    # one side of a copy: the window at ``base`` <-> the contiguous ``out``
    "    isz = row[%d]" % ITEM,
    "    n0, n1, n2, n3 = row[%d], row[%d], row[%d], row[%d]" % tuple(SHAPE + k for k in range(4)),
    "    s0, s1, s2, s3 = row[strides], row[strides + 1], row[strides + 2], row[strides + 3]",
    "    p = out",
    "    for a in range(n0):",
    "        for b in range(n1):",
    "            for c in range(n2):",
    "                at = base + a * s0 + b * s1 + c * s2",
    "                if gather:",
    "                    _dq_run(p, isz, at, s3, n3, isz)",
    "                else:",
    "                    _dq_run(at, s3, p, isz, n3, isz)",
    "                p += n3 * isz",
    "",
    "@_njit",
    "def _dq_span(base, row, strides):",
    # the bytes [lo, hi) a window at ``base`` touches (at most)
    "    lo = base",
    "    hi = base + row[%d]" % ITEM,
    "    for k in range(%d):" % RANK,
    "        s = row[strides + k] * (row[%d + k] - 1)" % SHAPE,
    "        if s >= 0:",
    "            hi += s",
    "        else:",
    "            lo += s",
    "    return lo, hi",
    "",
    "@_njit",
    "def _dq_direct(row):",
    # source and destination apart: copied straight, the two inner dims as
    # one run where both sides hold them contiguous
    "    isz = row[%d]" % ITEM,
    "    n0, n1, n2, n3 = row[%d], row[%d], row[%d], row[%d]" % tuple(SHAPE + k for k in range(4)),
    "    s0, s1, s2, s3 = row[%d], row[%d], row[%d], row[%d]" % tuple(SSTR + k for k in range(4)),
    "    d0, d1, d2, d3 = row[%d], row[%d], row[%d], row[%d]" % tuple(DSTR + k for k in range(4)),
    "    src, dst = row[%d], row[%d]" % (SRC, DST),
    "    if s3 == isz and d3 == isz and s2 == n3 * isz and d2 == n3 * isz:",
    "        for a in range(n0):",
    "            for b in range(n1):",
    "                _mcpy(dst + a * d0 + b * d1, src + a * s0 + b * s1, n2 * n3 * isz)",
    "        return",
    "    for a in range(n0):",
    "        for b in range(n1):",
    "            for c in range(n2):",
    "                _dq_run(dst + a * d0 + b * d1 + c * d2, d3, src + a * s0 + b * s1 + c * s2,",
    "                        s3, n3, isz)",
    "",
    "@_njit",
    "def _dq_move(row):",
    # the DMA of ``row`` completes: its source read now, its destination
    # written, its semaphore signalled with the bytes moved. Where the two
    # windows' byte ranges overlap, through a buffer (the NumPy rule reads
    # the whole source before it writes); else straight
    "    total = row[%d] * row[%d] * row[%d] * row[%d] * row[%d]" % (
        ITEM, SHAPE, SHAPE + 1, SHAPE + 2, SHAPE + 3),
    "    slo, shi = _dq_span(row[%d], row, %d)" % (SRC, SSTR),
    "    dlo, dhi = _dq_span(row[%d], row, %d)" % (DST, DSTR),
    "    if shi <= dlo or dhi <= slo:",
    "        _dq_direct(row)",
    "    else:",
    "        tmp = np.empty(total, np.uint8)",
    "        t = tmp.ctypes.data",
    "        _dq_strided(row[%d], row, %d, t, True)" % (SRC, SSTR),
    "        _dq_strided(row[%d], row, %d, t, False)" % (DST, DSTR),
    "    _st64(row[%d], _ld64(row[%d]) + total)" % (SEM, SEM),
    "",
    "@_njit",
    "def _dq_push(q, row):",
    # queue a started DMA; False when full
    "    if q[0, 0] == q[0, 1]:",
    "        q[0, 0] = 0",
    "        q[0, 1] = 0",
    "    n = q[0, 1]",
    "    if n + 1 >= q.shape[0]:",  # full: the live rows moved to the front, in order
    "        h = q[0, 0]",
    "        if h == 0:",
    "            return False",
    "        for r in range(h, n):",
    "            q[r - h + 1, :] = q[r + 1, :]",
    "        n -= h",
    "        q[0, 0] = 0",
    "        q[0, 1] = n",
    "    for j in range(len(row)):",
    "        q[n + 1, j] = row[j]",
    "    q[n + 1, %d] = q[0, 2]" % SEQ,
    "    q[0, 2] += 1",
    "    q[0, 1] = n + 1",
    "    return True",
    "",
    "@_njit",
    "def _dq_wait(_st, q, addr, value):",
    # the NumPy rule's wait where the NumPy queue holds nothing on ``addr``:
    # pop the oldest DMAs on it while its count is below ``value``, then
    # decrement it; False (nothing decremented) where the queue cannot
    # satisfy it or the NumPy queue may hold DMAs on it
    "    if _st[%d] != 0 or _st[%d] > %d:" % (MODE, PENDING_N, PENDING_MAX),
    "        return False",
    "    for j in range(_st[%d]):" % PENDING_N,
    "        if _st[%d + j] == addr:" % PENDING,
    "            return False",
    "    h, n = q[0, 0], q[0, 1]",
    "    while _ld64(addr) < value:",
    "        r = h",
    "        while r < n and not (q[r + 1, 0] >= 0 and q[r + 1, 1] == addr):",
    "            r += 1",
    "        if r == n:",
    "            q[0, 0] = h",
    "            return False",
    "        _dq_move(q[r + 1])",
    "        q[r + 1, 0] = -1",
    "        while h < n and q[h + 1, 0] < 0:",
    "            h += 1",
    "    q[0, 0] = h",
    "    _st64(addr, _ld64(addr) - value)",
    "    return True",
    "",
    "@_njit",
    "def _dq_flush(_st, q, addr):",
    # the rows queued on ``addr`` (%d: all; %d: none) started on the NumPy
    # path in order; 1 if one raised
    "    if addr == %d:" % NONE,
    "        return 0",
    "    h, n = q[0, 0], q[0, 1]",
    "    for r in range(h, n):",
    "        if q[r + 1, 0] >= 0 and (addr == %d or q[r + 1, 1] == addr):" % ALL,
    "            for j in range(%d):" % blas_calls.PYCALL_OPERANDS,
    "                _st[%d + j] = q[r + 1, %d + j]" % (OPERANDS, SCALARS),
    "            _st[%d] = q[r + 1, %d]" % (ORDER, SEQ),
    "            _st[%d] = q[r + 1, %d]" % (CALL_OWNER, OWN),
    "            site = q[r + 1, 0]",
    "            q[r + 1, 0] = -1",
    "            if _pycall(_st[%d], site, _st.ctypes.data) != 0:" % blas_calls.PYCALL,
    "                return 1",
    "    while h < n and q[h + 1, 0] < 0:",
    "        h += 1",
    "    q[0, 0] = h",
    "    return 0",
    "",
    "@_njit",
    "def _dq_call(_st, q, site, addr, starts, scalars):",
    # call site ``site`` back (its scalar operands, then a 0), the rows on
    # ``addr`` flushed first; a DMA it starts gets the next start order
    "    if _dq_flush(_st, q, addr) != 0:",
    "        return 1",
    "    for j in range(len(scalars) - 1):",
    "        _st[%d + j] = scalars[j]" % OPERANDS,
    "    _st[%d] = -1" % ORDER,
    "    _st[%d] = _st[%d]" % (CALL_OWNER, OWNER),
    "    if starts:",
    "        _st[%d] = q[0, 2]" % ORDER,
    "        q[0, 2] += 1",
    "    return _pycall(_st[%d], site, _st.ctypes.data)" % blas_calls.PYCALL,
    "", ""])


def setup(gen) -> None:
  """The queue (``dma_stash.Stash.q``, by address) at the function's entry."""
  if "dma_queue" in gen.headers:
    return
  gen.headers["dma_queue"] = HEADER
  gen.prologue.append(f"    _dq = _carray(_qptr(_st[{QADDR}]), ({CAPACITY + 1}, {WIDTH}))")


def _raise_if(gen, call) -> None:
  with gen.block(f"if {call} != 0:"):
    gen.emit("raise RuntimeError('pallas_np native loop: a DMA or semaphore call raised')")


def emit_callback(gen, k, scalars, flush: str, starts: bool) -> None:
  """Call site ``k`` back with its scalar operands (``scalars``: their
  variable names, in slot order), the rows on the semaphore address
  ``flush`` (an expression; ``ALL``, ``NONE``) started on the NumPy path
  first: its rule may pop that semaphore's queue, whose older entries
  they are. ``starts``: the site may start a DMA."""
  args = "".join(f"np.int64({name}), " for name in scalars)
  _raise_if(gen, f"_dq_call(_st, _dq, {k}, np.int64({flush}), {starts}, ({args}np.int64(0),))")


# -- the form compiled ---------------------------------------------------------------
class _Window:
  """A ref operand of a DMA through at most one indexer of static ints,
  dynamic scalar ints and ``pl.ds`` of static size: its in-bounds
  condition, byte address and (shape, byte strides) as expressions."""

  def __init__(self, ref, conds, addr, dims):
    self.ref, self.conds, self.addr, self.dims = ref, conds, addr, dims


def positions(eqn, tree):
  """The eqn's operand tree with each invar an ``OperandPos``."""
  marks = [OperandPos(i) for i in range(len(eqn.invars))]
  if hasattr(tree, "unflatten"):
    return tree.unflatten(marks)
  return jax.tree_util.tree_unflatten(tree, marks)


def _exact_dtype(eqn, k, ref) -> bool:
  """The compiled array holds the ref's own dtype (not a wider stand-in:
  bf16 held in float32, ``codegen.dtype_of``): its bytes are the DMA's."""
  aval = getattr(eqn.invars[k].aval, "inner_aval", None)
  try:
    return aval is not None and np.dtype(aval.dtype) == ref.dtype
  except TypeError:
    return False


def _window(eqn, ins, node, sem=False):
  """The ``_Window`` of operand tree ``node`` (invar positions), or None."""
  if isinstance(node, OperandPos):
    ref_k, transforms = node.k, ()
  elif isinstance(node, jc.TransformedRef) and isinstance(node.ref, OperandPos):
    ref_k, transforms = node.ref.k, tuple(node.transforms)
  else:
    return None
  ref = ins[ref_k]
  if ref.kind != "r":
    return None
  if sem:  # (semaphores: int64 cells, ``memory.allocate``)
    aval = getattr(eqn.invars[ref_k].aval, "inner_aval", None)
    if aval is None or not jc.is_semaphore_dtype(aval.dtype) or ref.dtype != np.int64:
      return None
  elif not _exact_dtype(eqn, ref_k, ref):
    return None
  if not all(isinstance(t, jc.NDIndexer) for t in transforms):
    return None
  leaves, tree = jax.tree_util.tree_flatten(transforms)
  atoms, vals = [], []
  for leaf in leaves:
    if isinstance(leaf, OperandPos):
      if leaf.k >= len(eqn.invars):
        return None
      atoms.append(eqn.invars[leaf.k])
      vals.append(ins[leaf.k])
    elif isinstance(leaf, (jc.TransformedRef, jc.NDIndexer)) or not np.isscalar(leaf):
      return None  # (an index ref: ``index_ref_slices``)
    else:
      atoms.append(jc.Literal(leaf, None))
      vals.append(None)
  try:
    access = RefAccess(tree, atoms, ref.shape, clamp=False, ref_dtype=ref.dtype)
  except Exception:  # noqa: BLE001 - any indexer this form does not take: the callback
    return None
  if access.dynamic_size or any(step[0] != "index" for step in access.steps):
    return None
  dyn = [v for a, v in zip(atoms, vals) if not isinstance(a, jc.Literal)]
  if any(v.kind != "s" or v.dtype.kind not in "iu" for v in dyn):
    return None
  # The view's axes as (size, byte stride expression), indexed step by step
  axes = [(n, f"{ref.name}.strides[{d}]") for d, n in enumerate(ref.shape)]
  conds, terms = [], []
  for _, dims, shape in access.steps:
    if len(dims) != len(axes) or tuple(n for n, _ in axes) != tuple(shape):
      return None
    new = []
    for d, (n, stride) in zip(dims, axes):
      if isinstance(d, indexing.DimSlice):
        size, step = d.size, int(d.stride)
        if not indexing.is_static(size) or step <= 0:
          return None
        size = int(size)
        extent = (size - 1) * step + 1
        if size <= 0 or extent > n:
          return None
        start, last = d.start, n - extent
        new.append((size, stride if step == 1 else f"{stride} * {step}"))
      elif isinstance(d, indexing.DimArray):
        return None
      else:
        start, last = d.value, n - 1
      if indexing.is_static(start):
        if not 0 <= int(start) <= last:
          return None
        if int(start):
          terms.append(f"{int(start)} * {stride}")
      else:
        i = f"np.int64({dyn[start.k].name})"
        conds.append(f"0 <= {i} <= {last}")
        terms.append(f"{i} * {stride}")
    axes = new
  if tuple(n for n, _ in axes) != tuple(access.result_shape):
    return None
  return _Window(ref, conds, " + ".join([f"np.int64({ref.name}.ctypes.data)", *terms]),
                 [(str(n), st) for n, st in axes])


def _sem_cell(eqn, ins, node):
  """(in-bounds conditions, address, ref name) of a DMA semaphore operand
  naming one int64 cell, or None."""
  w = _window(eqn, ins, node, sem=True)
  if w is None or w.dims:
    return None
  return w.conds, w.addr, w.ref.name


def _shape_of(eqn, ins, node):
  """(shape, dtype) of a DMA operand window through indexers of static
  sizes, or None: what a wait sizes its count by (its indices are never
  dereferenced, so never checked: ``tpu._dma_wait``)."""
  if isinstance(node, OperandPos):
    ref = ins[node.k]
    ok = ref.kind == "r" and _exact_dtype(eqn, node.k, ref)
    return (tuple(ref.shape), ref.dtype) if ok else None
  if not (isinstance(node, jc.TransformedRef) and isinstance(node.ref, OperandPos)):
    return None
  ref = ins[node.ref.k]
  transforms = tuple(node.transforms)
  if (ref.kind != "r" or not _exact_dtype(eqn, node.ref.k, ref)
      or not all(isinstance(t, jc.NDIndexer) for t in transforms)):
    return None
  leaves, tree = jax.tree_util.tree_flatten(transforms)
  if not all(isinstance(l, OperandPos) or np.isscalar(l) for l in leaves):
    return None
  atoms = [eqn.invars[l.k] if isinstance(l, OperandPos) else jc.Literal(l, None) for l in leaves]
  try:
    access = RefAccess(tree, atoms, ref.shape, clamp=True, ref_dtype=ref.dtype)
  except Exception:  # noqa: BLE001 - the callback decides
    return None
  if access.dynamic_size or any(step[0] != "index" for step in access.steps):
    return None
  return tuple(int(n) for n in access.result_shape), ref.dtype


def _if_all(conds) -> str:
  return "".join(f" and {c}" for c in conds)


def _flush_of(sem) -> str:
  """The callback's flush for a semaphore operand (conditions, address):
  its rows, or every row where its index is out of bounds."""
  conds, addr = sem[0], sem[1]
  return f"({addr} if {' and '.join(conds)} else {ALL})" if conds else addr


def emit_start(gen, eqn, ins, k, scalars, callback):
  """Site ``k``'s ``dma_start`` compiled, with ``callback(flush)`` (emits
  the call back) where it is not: the names of the refs it writes, or
  None where the form is not compiled."""
  if eqn.params.get("add", False):
    return None
  src, dst, dst_sem, src_sem, device_id = positions(eqn, eqn.params["tree"])
  if src_sem is not None or device_id is not None:
    return None
  s, d, sem = _window(eqn, ins, src), _window(eqn, ins, dst), _sem_cell(eqn, ins, dst_sem)
  if s is None or d is None or sem is None or s.ref.dtype != d.ref.dtype:
    return None
  shape = [n for n, _ in s.dims]
  if shape != [n for n, _ in d.dims] or len(shape) > RANK or 0 in [int(n) for n in shape]:
    return None
  pad = RANK - len(shape)
  fields = [(SITE, str(k)), (SEM, sem[1]), (SRC, s.addr), (DST, d.addr),
            (ITEM, str(s.ref.dtype.itemsize)), (SEQ, "0"), (OWN, f"_st[{OWNER}]")]
  fields += [(SHAPE + j, n) for j, n in enumerate(["1"] * pad + shape)]
  fields += [(SSTR + j, st) for j, st in enumerate(["0"] * pad + [st for _, st in s.dims])]
  fields += [(DSTR + j, st) for j, st in enumerate(["0"] * pad + [st for _, st in d.dims])]
  fields += [(SCALARS + j, name) for j, name in enumerate(scalars)]
  row = ", ".join(f"np.int64({expr})" for _, expr in sorted(fields))
  conds = _if_all(s.conds + d.conds + sem[0])
  with gen.block(f"if not (_st[{MODE}] == 0{conds} and _dq_push(_dq, ({row},))):"):
    callback(_flush_of(sem))
  return d.ref.name, sem[2]


def emit_wait(gen, eqn, ins, k, callback):
  """Site ``k``'s ``dma_wait`` compiled (see ``emit_start``): the name of
  the semaphore ref it writes, or None."""
  src, _, sem_node, _, device_id = positions(eqn, eqn.params["tree"])
  if device_id is not None:
    return None
  got, sem = _shape_of(eqn, ins, src), _sem_cell(eqn, ins, sem_node)
  if got is None or sem is None:
    return None
  shape, dt = got
  value = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
  with gen.block(f"if not ({' and '.join(sem[0]) or 'True'} and "
                 f"_dq_wait(_st, _dq, {sem[1]}, {value})):"):
    callback(_flush_of(sem))
  return (sem[2],)


def _scalar(eqn, ins, node):
  """An int64 expression of a scalar operand (an invar, a literal or a
  static baked into the tree), or None."""
  if isinstance(node, OperandPos):
    a = eqn.invars[node.k]
    if isinstance(a, jc.Literal):
      node = a.val
    else:
      v = ins[node.k]
      return f"np.int64({v.name})" if v.kind == "s" and v.dtype.kind in "iu" else None
  if isinstance(node, bool) or np.ndim(node) != 0 or np.asarray(node).dtype.kind not in "iu":
    return None
  return str(int(node))


def _sem_operand(eqn, ins, ref, transforms):
  node = jc.TransformedRef(ref, tuple(transforms)) if transforms else ref
  return _sem_cell(eqn, ins, node)


def emit_signal(gen, eqn, ins, callback):
  """A local ``semaphore_signal`` compiled: its count incremented in place
  (``dma.signal`` without a device's lock or race detector: MODE 0)."""
  ref, transforms, inc, device_id, core_index = positions(eqn, eqn.params["args_tree"])
  if device_id is not None or core_index is not None:
    return None
  sem, inc = _sem_operand(eqn, ins, ref, transforms), _scalar(eqn, ins, inc)
  if sem is None or inc is None:
    return None
  with gen.block(f"if _st[{MODE}] == 0{_if_all(sem[0])}:"):
    gen.emit(f"_st64({sem[1]}, _ld64({sem[1]}) + {inc})")
  with gen.block("else:"):
    callback(NONE)
  return (sem[2],)


def emit_semaphore_wait(gen, eqn, ins, callback):
  """A ``semaphore_wait`` that decrements, compiled as a DMA wait is
  (``dma.wait``: the DMAs queued on it popped while its count is too low)."""
  ref, transforms, value, decrement = positions(eqn, eqn.params["args_tree"])
  dec = decrement
  if isinstance(dec, OperandPos):
    a = eqn.invars[dec.k]
    dec = a.val if isinstance(a, jc.Literal) else None
  if dec is not None and (np.ndim(dec) != 0 or np.asarray(dec).dtype != np.bool_):
    dec = None
  sem, value = _sem_operand(eqn, ins, ref, transforms), _scalar(eqn, ins, value)
  if dec is None or not bool(dec) or sem is None or value is None:
    return None
  with gen.block(f"if not ({' and '.join(sem[0]) or 'True'} and "
                 f"_dq_wait(_st, _dq, {sem[1]}, {value})):"):
    callback(_flush_of(sem))
  return (sem[2],)
