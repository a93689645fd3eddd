"""What a loop's pre-key record holds, and what a later process reads from
it to skip work on its first calls (``tier.NativeLoop._prelookup``;
docs/native.md, "warm cache"; issue 41, "never slower than off").

A record (``record``, written by ``tier.NativeLoop._remember`` beside the
library) describes the loop's compiled signature without its source
(``Recorded``), whether the code reads addresses from its status array
(``reads_status``: a loop that does not runs with zeros and never looks
BLAS and libm up) and, for a kernel body, its probe's verdict (``probe``:
``probe_decision`` says whether a later process reuses it).
"""
from __future__ import annotations

import re

import numpy as np

# A compiled kernel body's probe (``bodies.BodyPlan``: its fastest step
# against the NumPy plan's) is recorded under the body's pre-key; a later
# process reuses a clear verdict instead of probing again: the body is not
# loaded at all where its compiled step took more than PROBE_DROP_RATIO of
# the NumPy plan's (``bodies.KEEP_RATIO``: any body its probe did not keep;
# a probe of a body that loses cost a warm process ~1-10 ms a call for its
# first calls: PERF_LOG "[never]"; one of a body at ~0.91 of its plan, which
# another probe could keep for a 10% gain at most, made int8_matmul's
# second process's first 20 calls ~1.3x slower than "off": PERF_LOG 164),
# and runs compiled from its first step where it took at most
# PROBE_KEEP_RATIO; in between (kept, but narrowly: another load may tip
# it), it is probed again, until PROBE_AGREED probes in a row decided
# alike: then their verdict is reused (an int8 matmul's body at ~0.84 of
# its plan was probed by every warm process, ~2 ms of its first 20 calls:
# the plan's first, uncompiled runs and the verdict's write).
PROBE_KEEP_RATIO = 0.8
PROBE_DROP_RATIO = 0.9
PROBE_AGREED = 2
# ``_st`` in a generated source other than its parameter and stores of
# literal slots (an error site, its index values, a lane): a read of the
# status array (BLAS or libm addresses, the transposed-operand slot, the DMA
# queue), which then needs ``blas_calls.status()``'s addresses.
_STATUS_READ = re.compile(r"\b_st\b(?!\[\d+\] = )")


class Recorded:
  """A loop's generated source as its pre-key record describes it: its
  signature, no text and no bounds-check sites (generated again when a
  check fails, ``NativeLoop._raise_oob``)."""

  def __init__(self, record):
    self.kinds = list(record["kinds"])
    self.written = set(record["written"])
    self.outs = [(kind, np.dtype(dt)) for kind, dt in record["outs"]]
    self.scratch = [(np.dtype(dt), n) for dt, n in record.get("scratch", ())]
    # (its dot sites' ``blas_calls.transposed_key``s: its status words; none, the copy)
    self.transposed = tuple(tuple(k) for k in record.get("transposed", ()))
    self.text, self.sites, self.globals = None, None, None


def reads_status(text: str) -> bool:
  """Whether a generated source reads its status array (``_STATUS_READ``)
  beyond its parameter: the addresses ``blas_calls.status`` finds are then
  needed; a source that only stores its error sites runs with zeros."""
  return any(not text.startswith("def native_loop(", max(m.start() - 16, 0))
             for m in _STATUS_READ.finditer(text))


def record(src, key, args, ret) -> dict:
  """The pre-key record of a loop built from ``src`` (a ``codegen.Source``)."""
  return {"key": key, "kinds": list(src.kinds), "written": sorted(src.written),
          "outs": [[kind, np.dtype(dt).str] for kind, dt in src.outs], "args": args, "ret": ret,
          "scratch": [[np.dtype(dt).str, n] for dt, n in src.scratch],
          "transposed": [list(k) for k in src.transposed],
          "addresses": reads_status(src.text)}


def probe_decision(rec) -> str | None:
  """``"kept"`` or ``"dropped"`` where the record's probe was clear, else
  None (no probe recorded, or one near ``bodies.KEEP_RATIO``)."""
  probe = rec.get("probe")
  if not probe or not probe.get("numpy"):
    return None
  ratio = probe["native"] / probe["numpy"]
  agreed = probe.get("agreed", 1) >= PROBE_AGREED
  if probe["kept"] and (ratio <= PROBE_KEEP_RATIO or agreed):
    return "kept"
  if not probe["kept"] and (ratio > PROBE_DROP_RATIO or agreed):
    return "dropped"
  return None


def probe_record(rec, kept: bool, numpy_s: float, native_s: float) -> dict:
  """``rec`` with this probe's verdict, counting the probes in a row that
  decided alike (``agreed``: ``probe_decision``)."""
  last = rec.get("probe") or {}
  agreed = last.get("agreed", 1) + 1 if last and bool(last.get("kept")) == bool(kept) else 1
  return dict(rec, probe={"kept": bool(kept), "numpy": numpy_s, "native": native_s,
                          "agreed": agreed})
