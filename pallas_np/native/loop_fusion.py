"""The elementwise loops of a generated function (``codegen.Gen``): one
loop for consecutive elementwise eqns of one size, which also computes the
elements of *lazy* operands in place and stores into ref blocks.

Why: a flash-attention step made ~20 passes of 64 KiB that only moved data
(PERF_LOG): a ref block copied before an elementwise op read it, an iota or
a row broadcast written out in full, an elementwise result copied into the
ref it is stored to. Here

* a lazy value (``Lazy``: an iota, a broadcast, a ref block read in place;
  ``shapes``, ``refs``) has no buffer: each loop that reads it computes its
  element from the element's indices (``lazy.expr(dims)``); any other
  reader gets it materialised first (``codegen.Gen.run_jaxpr``);
* a store of a value into a ref block (``swap``, ``addupdate``) is one more
  statement of the loop that computes the value, or of a loop of its own
  that the next elementwise eqns join.

Where a value's shape needs per-axis indices (a lazy operand of rank 2 or
more) the loop is a nest, rows outside and the last axis inside (``_fr``,
``_fc``; ``_i`` the flat index), so that an iota is the loop variable, a
row broadcast a load hoisted out of the inner loop, a ref block a
contiguous run, and LLVM still vectorizes the inner loop; else it is flat
(``_i``). An element's indices in another shape of the same size are
computed from ``_i``.

Ref accesses in one loop: the loop runs element by element, so a store and
a read of refs in it interleave, where the NumPy path finishes one before
the next starts. A ref a loop stores into is therefore accessed there
through one index expression only (the element read and written at an
element is then the same one, as on the NumPy path: read before written,
within the element); and two refs may be one buffer
(``input_output_aliases``, ``grid/buffers.shared_aliases``), except a
*private* one (``codegen.Gen.private``: a TPU VMEM ref, a scratch buffer or
a block copy of its own), so a loop that stores into a ref that is not
private accesses no other ref that is not. A store that cannot join opens a
new loop. (Lazy ref reads are made only where no eqn between the ``get``
and its readers can write a ref: ``shapes.ref_in_place``.)

Nothing here imports the code generator: ``codegen.Gen`` calls in.
"""
from __future__ import annotations

import math

# Values one fused elementwise loop holds: numba's compile time grows
# faster than linearly with the size of one loop body.
FUSE_MAX = 12
# A nest's inner loop (the last axis) at least this long: a shorter one
# keeps a flat loop (LLVM's vectorized inner loop would barely run).
NEST_MIN = 8


class Lazy:
  """An array value that has no buffer: ``expr(dims)`` -> (its element at
  the per-axis index expressions ``dims``, the ref accesses that reads:
  ``{(ref, index text)}``)."""
  __slots__ = ("expr",)

  def __init__(self, expr):
    self.expr = expr


class Loop:
  """The elementwise loop still open for fusion (valid while it is the
  last thing emitted: ``end``)."""
  __slots__ = ("size", "depth", "head", "end", "shape", "locals", "reads", "writes")

  def __init__(self, size, depth, head, end, shape):
    self.size, self.depth, self.head, self.end, self.shape = size, depth, head, end, shape
    self.locals: dict = {}  # value name -> its element's local in the body
    self.reads: set = set()  # (ref, index text) read in the body
    self.writes: set = set()  # ... written

  @property
  def pad(self) -> str:
    return "    " * (self.depth + (2 if self.shape is not None else 1))


def nests(shape) -> bool:
  """Whether a loop over ``shape`` is a nest (rows, then the last axis)."""
  return len(shape) >= 2 and shape[-1] >= NEST_MIN


def dims_of(loop: Loop, shape) -> list:
  """The per-axis index expressions, in ``loop``'s body, of the element of
  a value of ``shape`` (the loop's size) at the loop's element."""
  shape = tuple(shape)
  if not shape:
    return []
  if loop.shape is not None and shape == loop.shape:
    rows, flat, last = shape[:-1], "_fr", ["_fc"]
  else:
    rows, flat, last = shape, "_i", []
  out = []
  for d, n in enumerate(rows):
    inner = math.prod(rows[d + 1:])
    e = flat if inner == 1 else f"({flat} // {inner})"
    out.append(e if d == 0 else f"({e} % {n})")
  return out + last


def _header(gen, size, shape) -> list:
  d = "    " * gen.depth
  if shape is None:
    return [f"{d}for _i in range({size}):"]
  c = shape[-1]
  return [f"{d}for _fr in range({size // c}):", f"{d}    for _fc in range({c}):",
          f"{d}        _i = _fr * {c} + _fc"]


def _open(gen, size, shape) -> Loop:
  lines = _header(gen, size, shape)
  head = len(gen.lines)
  gen.lines.extend(lines)
  loop = Loop(size, gen.depth, head, len(gen.lines), shape)
  gen.fuse = loop
  return loop


def _nest(gen, loop: Loop, shape) -> None:
  """Turn the open flat ``loop`` into a nest over ``shape`` (its body
  indented one level more; ``_i`` stays the flat index)."""
  head = _header(gen, loop.size, shape)
  body = ["    " + line for line in gen.lines[loop.head + 1:loop.end]]
  gen.lines[loop.head:loop.end] = head + body
  loop.shape = tuple(shape)
  loop.end = len(gen.lines)


def _joinable(gen, loop, size) -> bool:
  return (loop is not None and loop.size == size and loop.depth == gen.depth
          and loop.end == len(gen.lines) and len(loop.locals) < FUSE_MAX)


def _legal(loop: Loop, reads, writes, private) -> bool:
  """Whether ``loop`` may also make these ref accesses (module doc;
  ``private``: the names of refs no other ref shares memory with)."""
  writes = loop.writes | set(writes)
  if not writes:
    return True
  accesses = loop.reads | set(reads) | writes
  for ref in {r for r, _ in writes}:
    if len({text for r, text in accesses if r == ref}) > 1:
      return False
    if ref not in private and any(r != ref and r not in private for r, _ in accesses):
      return False
  return True


def acquire(gen, shape, lazies=(), write=None) -> Loop:
  """The loop for an eqn over ``shape`` reading the ``lazies`` (lazy
  operands) and, where ``write`` (``dims -> (ref, index text)``), storing
  into a ref block: the open loop where it may join, else a new one."""
  shape = tuple(shape)
  size = math.prod(shape)
  want = shape if nests(shape) and (write is not None or any(
      v.shape == shape for v in lazies)) else None

  def accesses(loop):
    reads = set()
    for v in lazies:
      if v.name not in loop.locals:
        reads |= v.lazy.expr(dims_of(loop, v.shape))[1]
    writes = set()
    if write is not None:
      writes.add(write(dims_of(loop, shape)))
    return reads, writes

  loop = gen.fuse
  if isinstance(loop, Loop) and _joinable(gen, loop, size):
    if want is not None and loop.shape is None:
      _nest(gen, loop, want)
    if _legal(loop, *accesses(loop), gen.private):
      return loop
  return _open(gen, size, want)


def element(gen, loop: Loop, v) -> str:
  """The expression of ``v``'s element in ``loop``'s body: a scalar
  itself, else a local loaded (or computed, for a lazy value) once."""
  if v.kind != "a":
    return v.name
  local = loop.locals.get(v.name)
  if local is None:
    local = loop.locals[v.name] = "e" + v.name
    if v.lazy is not None:
      text, reads = v.lazy.expr(dims_of(loop, v.shape))
      loop.reads |= reads
    else:
      text = f"{v.name}[_i]"
    append(gen, loop, f"{local} = {text}")
  return local


def append(gen, loop: Loop, line: str) -> None:
  gen.lines.append(loop.pad + line)
  loop.end = len(gen.lines)


def elementwise(gen, out, expr, operands) -> None:
  """``out[_i] = expr(*operand elements)`` for every element, in the open
  loop where it may join."""
  loop = acquire(gen, out.shape, [v for v in operands if v.lazy is not None])
  names = [element(gen, loop, v) for v in operands]
  local = loop.locals[out.name] = "e" + out.name
  append(gen, loop, f"{local} = {expr(*names)}")
  append(gen, loop, f"{out.name}[_i] = {local}")


def store(gen, at, shape, ref: str, val, combine=None) -> bool:
  """``ref``'s block ``at`` (of ``shape``) set to ``val`` (an array of that
  shape; ``combine(old, new)``: its new element from both), as statements
  of an elementwise loop; False where it is not one (a 0-d block, a lazy
  value)."""
  if not shape or val.kind != "a" or val.lazy is not None or tuple(val.shape) != tuple(shape):
    return False
  write = lambda dims: (ref, at(dims))  # noqa: E731
  loop = acquire(gen, shape, write=write)
  access = write(dims_of(loop, shape))
  loop.writes.add(access)
  if combine is not None:
    loop.reads.add(access)
  src = element(gen, loop, val)
  target = access[1]
  append(gen, loop, f"{target} = {combine(target, src) if combine is not None else src}")
  return True
