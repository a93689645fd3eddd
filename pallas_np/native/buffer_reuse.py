"""One buffer for several eqns' array results of a generated loop whose
lives do not overlap (``codegen.finish``).

Why: every eqn's array result has a buffer allocated once at the loop
function's entry (``Gen.array``). A flash-attention step has ~28 of them of
64 KiB each, 1.8 MiB, past this CPU's 512 KiB L2 cache: each pass over a
buffer then streams it from L3 (PERF_LOG: ~90 of the step's ~150 µs
outside its GEMMs). Buffers of the same dtype and size whose values are
never live at once are one allocation here, so the passes of a step run
on a few buffers that stay in L2. Same operations, same order, same
values: only where they are kept changes.

How (on the generated text, after the dead stores are gone): a buffer's
life is the range of lines that name it or a name bound from it as a
whole (``u = v.view(...)``, ``p = np.int64(v.ctypes.data)``, a cond's
``y = v``: an alias or an address; an element read ``e = v[_i]`` is a
value, not an alias), widened to every loop (``for``/``while`` block) it
crosses the boundary of: a value made before a loop and read in it is
read again in the next iteration; one made in a loop and read after it
(or past a ``break``) must survive the rest of the loop. A buffer is
written before it is read within its range (each eqn writes its whole
result before any later eqn reads it; a carry is a copy), so two buffers
whose ranges are disjoint can share storage. Two buffers read or written
by one loop overlap there: a loop never sees one allocation under two
names (LLVM keeps its no-alias facts about separate allocations and
vectorizes as before).
"""
from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z_]\w*")
# ``a, b, = ...`` or ``a = ...``: plain names bound (not ``v[i] = ...``)
_BIND = re.compile(r"^\s*([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*\s*,?)\s*=(?!=)(.*)$")
_LOOP = re.compile(r"^\s*(for |while )")


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip(" "))


def _enclosing(lines) -> list:
  """For every line, the (header line, last body line) of each
  ``for``/``while`` block it lies in (one pass: a block ends before the
  first later line indented no deeper)."""
  ends: dict = {}
  open_, chains = [], []  # open_: [(indent, header line)]
  last = -1
  for k, line in enumerate(lines):
    if line.strip():
      ind = _indent(line)
      while open_ and ind <= open_[-1][0]:
        ends[open_.pop()[1]] = last
      last = k
    if line.strip() and _LOOP.match(line):
      open_.append((_indent(line), k))
    chains.append(tuple(start for _, start in open_))  # (a header lies in its own block)
  for _, start in open_:
    ends[start] = last
  return [tuple((start, ends[start]) for start in chain) for chain in chains]


# a name not followed by ``[``: the object itself (not an element read)
_WHOLE = re.compile(r"\b([A-Za-z_]\w*)\b(?!\s*\[)")


def _lives(lines, names) -> dict:
  """name -> [first, last] line of its buffer's life (see the module doc)."""
  where: dict = {}  # name -> the lines naming it
  for k, line in enumerate(lines):
    for t in set(_NAME.findall(line)):
      where.setdefault(t, []).append(k)
  bound: dict = {}  # name -> the names bound from it whole
  for line in lines:
    m = _BIND.match(line)
    if m:
      targets = {t.strip() for t in m.group(1).split(",") if t.strip()}
      for src in set(_WHOLE.findall(m.group(2))):
        bound.setdefault(src, set()).update(targets)
  enclosing = _enclosing(lines)
  lives = {}
  for name in names:
    related, todo = {name}, [name]
    while todo:  # the names bound from the buffer (or from those), transitively
      for t in bound.get(todo.pop(), ()):
        if t not in related:
          related.add(t)
          todo.append(t)
    ks = [k for r in related for k in where.get(r, ())]
    if not ks:
      continue
    lo, hi = min(ks), max(ks)
    while True:  # a life that crosses a loop's boundary spans the whole loop
      crossed = [(s, e) for s, e in set(enclosing[lo]) ^ set(enclosing[hi])  # (one end only)
                 if s < lo or e > hi]
      if not crossed:
        break
      lo, hi = min(lo, *(s for s, _ in crossed)), max(hi, *(e for _, e in crossed))
    lives[name] = (lo, hi)
  return lives


def share(lines, temps):
  """(lines, temps) with each buffer of ``temps`` ((name, elements,
  dtype), allocated at the entry) renamed to an earlier one of the same
  dtype and size whose life ended before its own began; the buffers left
  to allocate."""
  lives = _lives(lines, [name for name, _, _ in temps])
  kind = {name: (n, dt) for name, n, dt in temps}
  free: dict = {}  # (elements, dtype) -> [(last line, buffer)] of buffers whose lives ended
  busy = []  # (last line, buffer, (elements, dtype))
  rename, kept = {}, []
  for name in sorted((n for n in lives), key=lambda n: lives[n][0]):
    lo, hi = lives[name]
    for entry in [b for b in busy if b[0] < lo]:
      busy.remove(entry)
      free.setdefault(entry[2], []).append(entry[1])
    key = kind[name]
    pool = free.get(key)
    buf = pool.pop() if pool else name
    if buf != name:
      rename[name] = buf
    busy.append((hi, buf, key))
  kept = [t for t in temps if t[0] not in rename]
  if not rename:
    return lines, kept
  pattern = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b")
  return [pattern.sub(lambda m: rename[m.group(1)], line) for line in lines], kept
