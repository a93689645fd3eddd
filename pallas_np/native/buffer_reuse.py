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


def _loops(lines) -> list:
  """(header line, last body line) of every ``for``/``while`` block."""
  out = []
  for k, line in enumerate(lines):
    if _LOOP.match(line):
      ind, end = _indent(line), k
      for j in range(k + 1, len(lines)):
        if lines[j].strip() and _indent(lines[j]) <= ind:
          break
        end = j
      out.append((k, end))
  return out


def _whole_use(name: str, text: str) -> bool:
  """Whether ``text`` names ``name`` other than as an element read
  ``name[...]``."""
  return re.search(rf"\b{re.escape(name)}\b(?!\s*\[)", text) is not None


def _lives(lines, names) -> dict:
  """name -> [first, last] line of its buffer's life (see the module doc)."""
  tokens = [set(_NAME.findall(line)) for line in lines]
  binds = []  # (line, bound names, right-hand side)
  for k, line in enumerate(lines):
    m = _BIND.match(line)
    if m:
      binds.append((k, [t.strip() for t in m.group(1).split(",") if t.strip()], m.group(2)))
  loops = _loops(lines)
  lives = {}
  for name in names:
    related = {name}
    grew = True
    while grew:  # the names bound from the buffer (or from those), transitively
      grew = False
      for _, targets, rhs in binds:
        if any(_whole_use(r, rhs) for r in related if r in rhs) and not set(targets) <= related:
          related.update(targets)
          grew = True
    ks = [k for k, t in enumerate(tokens) if t & related]
    if not ks:
      continue
    lo, hi = ks[0], ks[-1]
    grew = True
    while grew:  # a life that crosses a loop's boundary spans the whole loop
      grew = False
      for start, end in loops:
        if lo <= end and hi >= start and not (start <= lo and hi <= end):
          if start < lo or end > hi:
            lo, hi = min(lo, start), max(hi, end)
            grew = True
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
