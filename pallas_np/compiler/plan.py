"""A compiled plan and how it runs.

``Plan`` is a jaxpr compiled to a straight-line Python function
(``pallas_np.compiler.compiler`` builds it). It runs compiled, or, for its
first calls, as data through the line runner (no ``compile()``). Also here:
the run context ctx-rules read, the code-object cache, and which eqn a
traceback frame of a plan was running (``failing_eqns``).
"""
from __future__ import annotations

import types
from time import perf_counter as _perf

from pallas_np.compiler import sourcemap
from pallas_np.lru import LRU


class RunContext:
  """Per-execution state that ctx-rules read: where in the grid we are."""
  __slots__ = ("program_ids", "num_programs", "kernel_name", "params",
               "grid_point", "family", "rules", "batch_size", "device", "t0")

  def __init__(self, kernel_name="kernel", params=None, program_ids=(),
               num_programs=()):
    # When the run began (perf_counter): the native tier weighs what it
    # costs the caller against the kernel's seconds, not only its loop's
    # (native/tier.py, ``CALLER_SHARE``).
    self.t0 = _perf()
    self.kernel_name = kernel_name
    self.params = params
    self.program_ids = program_ids
    self.num_programs = num_programs
    self.grid_point = ()
    # The kernel family's typed context of this thread (a Mosaic GPU
    # warpgroup's kernel_context.ThreadContext), else None.
    self.family = None
    # Stateful rules' state for this run (kernel_context.RuleState: DMAs,
    # MXUs, the PRNG), created on first use by kernel_context.rule_state.
    self.rules = None
    # Lanes of a vectorized pass (pallas_np.grid.vectorize); None when sequential.
    self.batch_size = None
    # The kernel instance's devices.DeviceContext in a multi-device run, else None.
    self.device = None


# Code objects by generated source (without the function name): index maps,
# cond branches and loop bodies often generate the same text, and Python's
# compile() is the biggest part of a small plan's cost.
_CODE_CACHE_SIZE = 2048
_code_cache = LRU(_CODE_CACHE_SIZE)


def function_code(signature_and_body: str) -> types.CodeType:
  code = _code_cache.get(signature_and_body)
  if code is None:
    module = compile("def plan" + signature_and_body, "<pallas_np plan>", "exec")
    code = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    _code_cache.put(signature_and_body, code)
  return code


# A plan built with ``first_calls=True`` runs its lines without compiling
# them (``_line_runner``) until this many calls, or until a later kernel run
# (``new_run``) calls it: Python's compile() costs far more per generated line
# than the runner's overhead per line per call over compiled code, and a
# first call is often the only call (one grid point, a few batched slabs).
FIRST_CALLS = 8
_run_epoch = [0]


def new_run():
  """A kernel run starts: plans that ran lines for an earlier run compile."""
  _run_epoch[0] += 1


class Plan:
  """A compiled jaxpr: ``plan(ctx, *args) -> tuple of outputs``.

  ``fn`` is the generated Python function, or, for the first calls of a
  ``first_calls`` plan, the line runner (which swaps ``fn`` for the compiled
  function when it is done). ``line_eqns`` owns the plan's source map
  entry (see ``sourcemap``): the generated function's globals and the line
  runner's hold it too."""
  __slots__ = ("fn", "jaxpr", "filename", "num_eqns", "line_eqns", "out_batched",
               "const_outputs", "lane_access_bytes", "_text", "_source",
               "_compiled", "_calls", "_epoch")

  def __init__(self, jaxpr, filename, line_eqns, text):
    self.out_batched = ()
    self.lane_access_bytes = 0  # batched plans: see state.lane_access.count_lane_bytes
    # Outputs that are constants of the plan (the same array every call).
    self.const_outputs = frozenset()
    self.jaxpr = jaxpr
    self.filename = filename
    self.line_eqns = line_eqns  # a sourcemap.LineEqns: line -> eqn
    self.num_eqns = len(line_eqns) - 2  # (the def and return lines have none)
    self._text = text  # (function name, arg names, body lines, returned names, globals)
    self._source = None
    self._compiled = None
    self._calls = 0
    self._epoch = None  # the run of its first call
    self.fn = None

  def __call__(self, ctx, *args):
    return self.fn(ctx, *args)

  @property
  def source(self) -> str:
    if self._source is None:
      fname, arg_names, body, ret, _ = self._text
      lines = [f"def {fname}(ctx{''.join(', ' + a for a in arg_names)}):"]
      lines += ["    " + b.render() for b in body]
      lines.append(f"    return ({', '.join(ret)}{',' if len(ret) == 1 else ''})")
      self._source = "\n".join(lines) + "\n"
    return self._source

  def compiled(self):
    """The generated function (compiled on first use); from now on ``fn``."""
    fn = self._compiled
    if fn is None:
      source = self.source
      fname, _, _, _, env_globals = self._text
      code = function_code(source[source.index("("):]).replace(
          co_filename=self.filename, co_name=fname, co_qualname=fname)
      # Make the generated source visible to tracebacks, pdb and py-spy.
      sourcemap.show(self.filename, source)
      fn = self._compiled = types.FunctionType(code, env_globals, fname)
    self.fn = fn
    return fn

  def compile_on_call(self):
    """``fn`` compiles the plan when first called: for plans whose lines
    are usually inlined elsewhere (loop bodies, see ``loop_codegen``)."""
    def on_first_call(ctx, *args):
      return self.compiled()(ctx, *args)
    self.fn = on_first_call

  def run_lines_first(self):
    """``fn`` runs the lines uncompiled for the first calls (see FIRST_CALLS)."""
    runner = _line_runner(self)

    def first_calls(ctx, *args):
      if self._epoch is None:
        self._epoch = _run_epoch[0]
      if self._calls >= FIRST_CALLS or self._epoch != _run_epoch[0]:
        return self.compiled()(ctx, *args)
      self._calls += 1
      return runner(ctx, *args)
    self.fn = first_calls


def _run_lines(ctx, *args):
  """The body of every line runner; its globals are one plan's steps, and
  ``i`` is the running line (see ``failing_eqns``)."""
  regs = _template.copy()
  regs[0] = ctx
  regs[1:_num_args] = args
  for i, (fn, ins, flags, out, dels) in enumerate(_steps):
    if flags:
      fn = fn[any([regs[k] for k in flags])]
    value = fn(*[regs[k] for k in ins])
    if out.__class__ is int:
      regs[out] = value
    elif out is not None:
      for k, v in zip(out, value):
        regs[k] = v
    for k in dels:
      regs[k] = None
  return tuple([regs[k] for k in _returned])


def _line_runner(plan):
  """A function running a plan's lines as data: registers instead of
  locals, the same callables, no compile()."""
  _, arg_names, body, ret, env_globals = plan._text
  slots = {"ctx": 0}
  for a in arg_names:
    slots[a] = len(slots)
  slot = slots.setdefault  # slot(name, len(slots)): a name's register, new ones appended

  steps = []
  for line in body:
    fn = env_globals[line.callee]
    args = line.args
    if len(args) == 1 and args[0].__class__ is tuple:
      # ``name.shape[0]``: only a lane-stacked buffer's allocation
      ins = (slot(args[0][0], len(slots)),)
      fn = (lambda alloc: lambda x: alloc(x.shape[0]))(fn)
    else:
      ins = tuple([slot(a, len(slots)) for a in args])
    flags = tuple([slot(f, len(slots)) for f in line.flags]) if line.flags else ()
    outs = line.outs
    if not outs or (not line.unpack and outs[0] == "_"):
      out = None
    elif line.unpack:
      out = tuple([slot(o, len(slots)) for o in outs])
    else:
      out = slot(outs[0], len(slots))
    steps.append((fn, ins, flags, out, tuple([slot(d, len(slots)) for d in line.dels])))
  returned = tuple([slot(r, len(slots)) for r in ret])
  template = [None] * len(slots)
  for name, k in slots.items():
    if name in env_globals:  # constants: names of the generated function's globals
      template[k] = env_globals[name]
  scope = {"__builtins__": __builtins__, "_template": template, "_steps": steps,
           "_num_args": 1 + len(arg_names), "_returned": returned,
           "_filename": plan.filename, "_line_eqns": plan.line_eqns}
  return types.FunctionType(_run_lines.__code__, scope, "_run_lines")


def plan_filename(frame) -> str:
  """The plan a traceback frame runs (compiled or its line runner): the
  ``filename`` of its Plan, or the frame's own file name."""
  if frame.f_code is _run_lines.__code__:
    return frame.f_globals["_filename"]
  return frame.f_code.co_filename


def failing_eqns(tb) -> list:
  """Eqns of generated plans on a traceback, outermost first."""
  found = []
  while tb is not None:
    frame = tb.tb_frame
    line = tb.tb_lineno
    if frame.f_code is _run_lines.__code__:  # a line runner: its running line
      line = frame.f_locals.get("i", -2) + 2
    eqns = sourcemap.lookup(plan_filename(frame))
    if eqns is not None:
      if 0 < line - 1 < len(eqns) and eqns[line - 1] is not None:
        found.append(eqns[line - 1])
    tb = tb.tb_next
  return found
