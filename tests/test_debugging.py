"""Debugging on a laptop (issue 8): deliberately broken kernels and what
pallas_np says about them, checked against interpret=True where it has an
answer."""
import io
import itertools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

import pallas_np
from pallas_np import _compat as jc
from pallas_np import debugging, races
from tests.conftest import assert_same
from tests.tpu_helpers import scratch_reset_only_at_origin
from tests.helpers import run_both

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARALLEL = pltpu.CompilerParams(dimension_semantics=("parallel",))
ARBITRARY = pltpu.CompilerParams(dimension_semantics=("arbitrary",))


def _line_of(fn, marker):
  """file:line of the kernel source line containing ``marker``."""
  import inspect
  lines, start = inspect.getsourcelines(fn)
  for i, text in enumerate(lines):
    if marker in text:
      return f"{os.path.basename(__file__)}:{start + i}"
  raise AssertionError(marker)


# -- 1/2. errors that point at the kernel; bounds checks -------------------------
def off_by_one_kernel(x_ref, o_ref):
  i = pl.program_id(0)
  o_ref[...] = x_ref[pl.ds(i * 4 + 1, 4)]  # BUG: one past the end at i=1


def off_by_one(interpret, kernel=off_by_one_kernel, call=pl.pallas_call):
  return call(
      kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
      grid=(2,), in_specs=[pl.BlockSpec((8,), lambda i: (0,))],
      out_specs=pl.BlockSpec((4,), lambda i: (i,)), interpret=interpret)


def test_off_by_one_pl_ds_names_kernel_point_primitive_line():
  x = jnp.arange(8.0)
  call = off_by_one("numpy", call=pallas_np.pallas_call)
  with pytest.raises(IndexError) as info:
    call(x)
  err = info.value
  assert isinstance(err, pallas_np.KernelError)
  assert err.kernel == "off_by_one_kernel"
  assert err.program_ids == (1,)
  assert err.primitive == "get"
  line = _line_of(off_by_one_kernel, "BUG")
  assert line in err.source and line in str(err)
  assert "pl.ds(start=5, size=4)" in str(err) and "[5:9]" in str(err)
  assert type(err.__cause__) is IndexError  # the original, chained
  # Nothing left behind: the same call clamps fine, a correct one runs.
  clamped = off_by_one(pallas_np.InterpretParams(bounds_check="clamp"))(x)
  assert_same(clamped, off_by_one(True)(x))
  assert races.current() is None



def off_by_one_twin_kernel(x_ref, o_ref):
  i = pl.program_id(0)
  o_ref[...] = x_ref[pl.ds(i * 4 + 1, 4)]  # TWIN: the same code, another line


def test_identical_plans_share_code_but_each_names_its_own_line(monkeypatch):
  # Plans that generate the same text share one code object (compile() is
  # the biggest part of a small plan's cost); errors must still point at
  # each kernel's own source line.
  from pallas_np.compiler import plan as evaluator
  compiled = []
  monkeypatch.setattr(evaluator, "compile", lambda *a: compiled.append(a) or compile(*a),
                      raising=False)
  x = jnp.arange(8.0)
  errors, compiles = [], []
  for kernel in (off_by_one_kernel, off_by_one_twin_kernel):
    compiled.clear()
    call = off_by_one("numpy", kernel, call=pallas_np.pallas_call)
    with pytest.raises(IndexError) as info:
      call(x)
    errors.append(info.value)
    compiles.append(len(compiled))
  assert compiles[1] == 0  # the twin's plans are all cache hits
  assert errors[0].kernel == "off_by_one_kernel"
  assert errors[1].kernel == "off_by_one_twin_kernel"
  assert _line_of(off_by_one_kernel, "BUG") in errors[0].source
  assert _line_of(off_by_one_twin_kernel, "TWIN") in errors[1].source

def test_error_under_jit_keeps_message_and_next_call_works():
  # Compiled by XLA (whole_program=False), the kernel runs through
  # io_callback and its error comes back as XLA's runtime error.
  x = jnp.arange(8.0)
  program = off_by_one(pallas_np.InterpretParams(whole_program=False))
  with pytest.raises(jax.errors.JaxRuntimeError) as info:
    jax.jit(program)(x).block_until_ready()
  msg = str(info.value)
  assert "Pallas kernel 'off_by_one_kernel' at grid point (1,)" in msg
  assert "primitive 'get'" in msg and _line_of(off_by_one_kernel, "BUG") in msg
  assert "out-of-bounds" in msg
  with pytest.raises(IndexError) as info, pallas_np.kernel_errors():  # typed again
    jax.jit(program)(x).block_until_ready()
  assert info.value.program_ids == (1,) and str(info.value) in msg
  ok = jax.jit(lambda v: pallas_np.pallas_call(
      lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1),
      out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
      interpret=pallas_np.InterpretParams(whole_program=False))(v) * 1.0)(x)
  np.testing.assert_array_equal(np.asarray(ok), np.arange(8.0) + 1)


def test_error_of_an_eager_jit_is_typed():
  # A jit whose kernels are numpy mode (an eager pl.pallas_call is one) runs
  # in the NumPy evaluator directly: the kernel's own typed error, no XLA.
  x = jnp.arange(8.0)
  with pytest.raises(IndexError) as info:
    jax.jit(off_by_one("numpy"))(x)
  assert isinstance(info.value, pallas_np.KernelError)
  assert info.value.program_ids == (1,)
  assert _line_of(off_by_one_kernel, "BUG") in str(info.value)


def test_clamp_option_matches_interpret_true():
  run_both(lambda interp: off_by_one(
      pallas_np.InterpretParams(bounds_check="clamp") if interp == "numpy" else interp),
      jnp.arange(8.0))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int16, jnp.int32])
@pytest.mark.parametrize("shift, bad", [(0, None), (-1, -1), (1, 8)])
def test_integer_array_index_bounds(dtype, shift, bad):
  """An integer-array index is checked as a whole: a negative index (seen
  unsigned by the fast check) and one past the end both raise and name the
  bad index; clamp mode does what interpret=True does (a negative index
  gets the axis size added, then it is clamped)."""
  def kernel(i_ref, x_ref, o_ref):
    o_ref[...] = x_ref[i_ref[...]] * 2.0

  idx = (jnp.arange(8) + shift).astype(dtype)
  x = jnp.arange(8.0)
  make = lambda interp: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=interp)
  if bad is None:
    run_both(make, idx, x)
    return
  with pytest.raises(IndexError, match=rf"array index {bad} on axis 0"):
    make("numpy")(idx, x)
  clamped = make(pallas_np.InterpretParams(bounds_check="clamp"))(idx, x)
  want = np.arange(8) + shift
  np.testing.assert_array_equal(np.asarray(clamped), np.clip(want % 8 if bad < 0 else want,
                                                             0, 7) * 2.0)
  assert_same(clamped, make(True)(idx, x))


def test_out_of_bounds_write_raises():
  def kernel(x_ref, o_ref):
    o_ref[pl.ds(pl.program_id(0) * 4 + 2, 4)] = x_ref[...]  # BUG write

  call = pallas_np.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
      out_specs=pl.BlockSpec((8,), lambda i: (0,)))
  with pytest.raises(IndexError, match=r"grid point \(1,\) in primitive 'swap'.*\[6:10\]"):
    call(jnp.arange(8.0))


def deep_loop_kernel(x_ref, o_ref):
  def outer(i, acc):
    def inner(j, acc):
      return acc + x_ref[pl.ds(i * 2 + j, 2)]  # BUG: i*2+j+2 > 8 at i=3, j=1
    return jax.lax.fori_loop(0, 3, inner, acc)
  o_ref[...] = jax.lax.fori_loop(0, 4, outer, jnp.zeros((2,), jnp.float32))


def test_failing_primitive_deep_in_fori_loop():
  call = pallas_np.pallas_call(deep_loop_kernel,
                               out_shape=jax.ShapeDtypeStruct((2,), jnp.float32))
  with pytest.raises(IndexError) as info:
    call(jnp.arange(8.0))
  msg = str(info.value)
  assert info.value.source.endswith("(deep_loop_kernel.<locals>.outer.<locals>.inner)")
  assert _line_of(deep_loop_kernel, "BUG") in msg
  assert "called from" in msg and "pl.ds(start=7, size=2)" in msg


def test_error_in_cond_branch():
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)

    @pl.when(i == 1)
    def _():
      o_ref[...] = x_ref[pl.ds(i * 5, 4)]  # BUG in a branch

    @pl.when(i == 0)
    def _():
      o_ref[...] = x_ref[pl.ds(0, 4)]

  call = pallas_np.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec((8,), lambda i: (0,))],
      out_specs=pl.BlockSpec((4,), lambda i: (i,)))
  with pytest.raises(IndexError) as info:
    call(jnp.arange(8.0))
  assert info.value.program_ids == (1,)
  assert _line_of(kernel, "BUG in a branch") in str(info.value)


def copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def shifted_blocks(interpret):
  return pl.pallas_call(
      copy_kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec((4,), lambda i: (i + 1,))],  # BUG: block 2 of 2
      out_specs=pl.BlockSpec((4,), lambda i: (i,)), interpret=interpret)


def test_index_map_block_out_of_range():
  with pytest.raises(Exception) as info:  # under pl.pallas_call's jit: JaxRuntimeError
    shifted_blocks("numpy")(jnp.arange(8.0))
  msg = str(info.value)
  assert "grid point (1,) in the index map of args[0]" in msg, msg
  assert "block index (2,)" in msg
  run_both(lambda interp: shifted_blocks(
      pallas_np.InterpretParams(bounds_check="clamp") if interp == "numpy" else interp),
      jnp.arange(8.0))


def test_error_inside_index_map_names_operand():
  gs = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(2,),
      in_specs=[pl.BlockSpec((4,), lambda i, s: (s[i + 1],))],  # BUG: s[2]
      out_specs=pl.BlockSpec((4,), lambda i, s: (i,)))
  call = pallas_np.pallas_call(
      lambda s_ref, x_ref, o_ref: copy_kernel(x_ref, o_ref),
      out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), grid_spec=gs)
  with pytest.raises(IndexError, match=r"at grid point \(1,\) in the index map of .*"
                     r"primitive 'get'.*index 2 on axis 0"):
    call(jnp.array([0, 1], jnp.int32), jnp.arange(8.0))


# -- 3. uninitialised memory -------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16, jnp.int8,
                                   jnp.int16, jnp.int32, jnp.uint8, jnp.uint32,
                                   jnp.bool_, jnp.float8_e4m3fn, jnp.int4])
def test_uninitialized_fill_is_jaxs(dtype):
  from jax._src.pallas import primitives as pallas_primitives
  want = np.asarray(pallas_primitives.uninitialized_value((), dtype))
  assert_same(jc.uninitialized_value_np(dtype), want)


def read_before_write(dtype, interpret):
  def kernel(x_ref, o_ref, scratch_ref):
    o_ref[...] = scratch_ref[...]  # BUG: scratch never written
    scratch_ref[...] = x_ref[...]

  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((2, 8), dtype), grid=(2,),
      in_specs=[pl.BlockSpec((1, 8), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((1, 8), lambda i: (i, 0)),
      scratch_shapes=[pltpu.VMEM((1, 8), dtype)], interpret=interpret)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bfloat16, jnp.uint8, jnp.bool_])
def test_read_before_write_scratch_matches_interpret_true(dtype):
  x = jnp.ones((2, 8), dtype)
  got = run_both(lambda interp: read_before_write(dtype, interp), x)
  zero = read_before_write(dtype, pallas_np.InterpretParams(uninitialized="zero"))(x)
  np.testing.assert_array_equal(np.asarray(zero)[0], np.zeros(8, dtype))
  np.testing.assert_array_equal(np.asarray(zero)[1], np.ones(8, dtype))
  assert np.asarray(got)[1].tolist() == np.ones(8, dtype).tolist()


def test_unwritten_output_block_matches_interpret_true():
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = x_ref[...]

  run_both(lambda interp: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.int32), grid=(2,),
      in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
      out_specs=pl.BlockSpec((4,), lambda i: (i,)), interpret=interp),
      jnp.arange(8, dtype=jnp.int32))


# -- 4. races ------------------------------------------------------------------
def one_block_for_all(interpret, compiler_params):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]  # BUG on a parallel axis: every point writes block 0

  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
      out_specs=pl.BlockSpec((4,), lambda i: (0,)),
      compiler_params=compiler_params, interpret=interpret)


RACES = pallas_np.InterpretParams(detect_races=True)


def test_two_parallel_points_writing_one_block():
  with pytest.raises(pallas_np.RaceError) as info, pallas_np.kernel_errors():
    one_block_for_all(RACES, PARALLEL)(jnp.arange(8.0))
  err = info.value
  assert err.buffer == "outputs" and err.grid_points == ((0,), (1,))
  assert "grid points (0,) and (1,) both map its block (0,)" in str(err)
  assert "parallel grid axis 0 (dimension_semantics=('parallel',))" in str(err)
  assert races.current() is None
  # GPU: no block write-back; the race is on the elements both points store.
  with pytest.raises(pallas_np.RaceError) as info, pallas_np.kernel_errors():
    one_block_for_all(RACES, pltriton.CompilerParams())(jnp.arange(8.0))
  assert "grid point (1,) writes element (0,) that grid point (0,) wrote" in str(info.value)
  assert info.value.primitive == "swap" and info.value.grid_points == ((0,), (1,))


def test_race_detection_does_not_share_compiled_accesses():
  """Equal ref accesses share one compiled indexer (RefAccess.shared), but
  one under detect_races has its own, wrapped one: a kernel compiled
  without detection first must not hide the race, nor leak the wrapper."""
  x = jnp.arange(8.0)
  gpu = pltriton.CompilerParams()
  plain = one_block_for_all(pallas_np.InterpretParams(), gpu)(x)
  with pytest.raises(pallas_np.RaceError, match="writes element"), pallas_np.kernel_errors():
    one_block_for_all(RACES, gpu)(x)
  again = one_block_for_all(pallas_np.InterpretParams(), gpu)(x)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(again))
  np.testing.assert_array_equal(np.asarray(again), np.arange(4.0, 8.0))
  assert races.current() is None


def test_disjoint_writes_to_one_block_race_on_tpu_not_gpu():
  def make(interpret, compiler_params):
    def kernel(x_ref, o_ref):
      o_ref[pl.ds(pl.program_id(0) * 2, 2)] = x_ref[...]
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32), grid=(2,),
        in_specs=[pl.BlockSpec((2,), lambda i: (i,))],
        out_specs=pl.BlockSpec((4,), lambda i: (0,)),
        compiler_params=compiler_params, interpret=interpret)
  with pytest.raises(pallas_np.RaceError, match="both map its block"), \
      pallas_np.kernel_errors():
    make(RACES, PARALLEL)(jnp.arange(4.0))
  run_both(lambda interp: make(RACES if interp == "numpy" else interp,
                               pltriton.CompilerParams()), jnp.arange(4.0))


def test_same_block_on_arbitrary_axis_is_no_race():
  run_both(lambda interp: one_block_for_all(RACES if interp == "numpy" else interp,
                                            ARBITRARY), jnp.arange(8.0))


def test_parallel_axes_override_without_compiler_params():
  with pytest.raises(pallas_np.RaceError), pallas_np.kernel_errors():
    one_block_for_all(pallas_np.InterpretParams(detect_races=True, parallel_axes=(0,)),
                      None)(jnp.arange(8.0))


def test_read_of_element_another_parallel_point_wrote():
  make = scratch_reset_only_at_origin(2)

  with pytest.raises(pallas_np.RaceError) as info, pallas_np.kernel_errors():
    make(RACES)(jnp.ones((2, 8)))
  assert "scratch_operands[0]" in str(info.value)
  assert info.value.grid_points == ((0, 2), (1, 0))
  assert "grid point (1, 0) reads element (0, 0) that grid point (0, 2) wrote" in str(info.value)
  # Without detection, the result is interpret=True's (the bug is silent there).
  run_both(make, jnp.ones((2, 8)))


def test_correct_parallel_kernel_passes_race_detection():
  def make(interpret):
    return pl.pallas_call(
        copy_kernel, out_shape=jax.ShapeDtypeStruct((4, 8), jnp.float32), grid=(4,),
        in_specs=[pl.BlockSpec((1, 8), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((1, 8), lambda i: (i, 0)),
        compiler_params=PARALLEL, interpret=RACES if interpret == "numpy" else interpret)
  run_both(make, jnp.arange(32.0).reshape(4, 8))


def test_masked_stores_race_only_where_unmasked_elements_overlap():
  def make(overlap):
    def kernel(x_ref, o_ref):
      i = pl.program_id(0)
      lanes = jnp.arange(8)
      mask = (lanes // (4 if not overlap else 5)) == i  # overlap: lane 4 both
      pltriton.store(o_ref.at[pl.ds(0, 8)], x_ref[...], mask=mask | (overlap & (lanes == 4)))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), grid=(2,),
        in_specs=[pl.BlockSpec((8,), lambda i: (0,))],
        out_specs=pl.BlockSpec((8,), lambda i: (0,)),
        compiler_params=pltriton.CompilerParams(), interpret=RACES)
  out = make(False)(jnp.arange(8.0))
  np.testing.assert_array_equal(np.asarray(out), np.arange(8.0))
  with pytest.raises(pallas_np.RaceError, match=r"element \(4,\)"), pallas_np.kernel_errors():
    make(True)(jnp.arange(8.0))


# -- 5. printing, pdb, trace ---------------------------------------------------
def printing_kernel(x_ref, o_ref):
  pl.debug_print("x0={}", x_ref[0])
  jax.debug.print("pid={i} block={b}", i=pl.program_id(1), b=x_ref[...])
  o_ref[...] = x_ref[...]


def printing(interpret):
  return pl.pallas_call(
      printing_kernel, out_shape=jax.ShapeDtypeStruct((2, 4), jnp.float32), grid=(2, 2),
      in_specs=[pl.BlockSpec((None, 2), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((None, 2), lambda i, j: (i, j)), interpret=interpret)


def test_debug_print_in_grid_order_with_grid_point(capsys):
  x = jnp.arange(8.0).reshape(2, 4)
  jax.block_until_ready(printing(True)(x))
  want = capsys.readouterr().out.splitlines()
  jax.block_until_ready(printing("numpy")(x))
  got = capsys.readouterr().out.splitlines()
  expected = []
  for i, j in itertools.product(range(2), range(2)):  # grid order, program order
    block = np.asarray(x)[i, 2 * j:2 * j + 2]
    expected += [f"[printing_kernel {(i, j)}] x0={block[0]}",
                 f"[printing_kernel {(i, j)}] pid={j} block={block}"]
  assert got == expected
  # interpret=True prints the same lines (its order within a step may vary).
  assert sorted(line.split("] ", 1)[1] for line in got) == sorted(want)


def test_pdb_at_failing_eqn(monkeypatch, capsys):
  commands = ["p type(x_ref).__name__, x_ref.shape", "p ctx.grid_point",
              "p x_ref[5]", "c"]
  monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(commands) + "\n"))
  with pytest.raises(IndexError), pallas_np.kernel_errors():
    off_by_one(pallas_np.InterpretParams(pdb=True))(jnp.arange(8.0) * 10)
  out = capsys.readouterr().out
  assert "failing eqn:" in out and _line_of(off_by_one_kernel, "BUG") in out
  assert "('ndarray', (8,))" in out  # the ref, as a NumPy array
  assert "(1,)" in out and "50.0" in out


def test_trace_called_per_grid_point():
  seen = []
  params = pallas_np.InterpretParams(trace=lambda name, point: seen.append((name, point)))
  printing_free = pl.pallas_call(
      copy_kernel, out_shape=jax.ShapeDtypeStruct((4, 6), jnp.float32), grid=(2, 3),
      in_specs=[pl.BlockSpec((2, 2), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((2, 2), lambda i, j: (i, j)), interpret=params)
  jax.block_until_ready(printing_free(jnp.ones((4, 6))))
  assert seen == [("copy_kernel", p) for p in itertools.product(range(2), range(3))]


# -- 7. progress -----------------------------------------------------------------
def _progress_run(params):
  call = pallas_np.pallas_call(
      copy_kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), grid=(16,),
      in_specs=[pl.BlockSpec((1,), lambda i: (i,))],
      out_specs=pl.BlockSpec((1,), lambda i: (i,)), interpret=params)
  call(jnp.ones(16))


def test_progress_bar_after_threshold_and_opt_outs(monkeypatch, capsys):
  monkeypatch.setattr(debugging, "_tqdm", lambda: None)  # the stderr line, even with tqdm
  monkeypatch.setattr(debugging, "PROGRESS_AFTER_S", 0.0)
  _progress_run(pallas_np.InterpretParams())
  err = capsys.readouterr().err
  assert "pallas_np copy_kernel: [" in err and "16/16 grid points" in err
  _progress_run(pallas_np.InterpretParams(progress=False))
  assert capsys.readouterr().err == ""
  monkeypatch.setenv("PALLAS_NP_PROGRESS", "0")
  _progress_run(pallas_np.InterpretParams())
  assert capsys.readouterr().err == ""
  monkeypatch.delenv("PALLAS_NP_PROGRESS")
  monkeypatch.setattr(debugging, "PROGRESS_AFTER_S", 3600.0)
  _progress_run(pallas_np.InterpretParams())  # a short grid shows nothing
  assert capsys.readouterr().err == ""


# -- 6. whole-program switch -----------------------------------------------------
PROGRAM = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    {extra_import}

    def kernel(x_ref, o_ref):
      pl.debug_print("hello from {{}}", pl.program_id(0))
      o_ref[...] = x_ref[...] * 2

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32),
                         grid=(2,), in_specs=[pl.BlockSpec((2,), lambda i: (i,))],
                         out_specs=pl.BlockSpec((2,), lambda i: (i,)),
                         interpret=True)(jnp.arange(4.0))
    print("argv", sys.argv[1:], "out", [float(v) for v in out])

    try:  # two parallel grid points write one output block
      pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                     out_shape=jax.ShapeDtypeStruct((2,), jnp.float32), grid=(2,),
                     in_specs=[pl.BlockSpec((2,), lambda i: (i,))],
                     out_specs=pl.BlockSpec((2,), lambda i: (0,)),
                     compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
                     interpret=True)(jnp.arange(4.0)).block_until_ready()
      print("no race reported")
    except Exception as e:
      print("race reported" if "data race on outputs" in str(e) else repr(e))
""")


def _run(args, tmp_path, env_extra=None, **kw):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", **(env_extra or {}))
  env.pop("PALLAS_NP_FORCE", None)
  env.update(env_extra or {})
  return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120, **kw)


def test_python_dash_m_pallas_np_runs_unmodified_program(tmp_path):
  script = tmp_path / "prog.py"
  script.write_text(PROGRAM.format(extra_import=""))
  res = _run(["-m", "pallas_np", "--detect-races", str(script), "a", "--b"], tmp_path)
  assert res.returncode == 0, res.stderr
  assert "[kernel (0,)] hello from 0\n[kernel (1,)] hello from 1\n" in res.stdout
  assert "argv ['a', '--b'] out [0.0, 2.0, 4.0, 6.0]" in res.stdout
  assert "race reported" in res.stdout


def test_python_dash_m_pallas_np_grid_report(tmp_path):
  script = tmp_path / "prog.py"
  script.write_text(PROGRAM.format(extra_import=""))
  res = _run(["-m", "pallas_np", "--grid-report", str(script)], tmp_path)
  assert res.returncode == 0, res.stderr
  assert "pallas_np grid report (2 kernels):" in res.stderr
  # pl.debug_print observes grid order, so that kernel ran in order, and says why.
  assert "kernel  grid (2,): sequential  (" in res.stderr
  assert "no race reported" in res.stdout


def test_env_var_forces_numpy_mode_at_import(tmp_path):
  script = tmp_path / "prog.py"
  script.write_text(PROGRAM.format(extra_import="import pallas_np"))
  res = _run([str(script)], tmp_path, env_extra={"PALLAS_NP_FORCE": "1"})
  assert res.returncode == 0, res.stderr
  assert "[kernel (1,)] hello from 1" in res.stdout
  assert "no race reported" in res.stdout  # detection is opt-in


def test_pytest_plugin_option(tmp_path):
  (tmp_path / "test_kernels.py").write_text(textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      from jax.experimental import pallas as pl

      def shift(x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(pl.program_id(0) * 4 + 1, 4)]

      def test_double():
        out = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., 2 * x_ref[...]),
                             out_shape=jax.ShapeDtypeStruct((4,), jnp.float32),
                             interpret=True)(jnp.arange(4.0))
        np.testing.assert_array_equal(out, [0, 2, 4, 6])

      def test_off_by_one_passes_only_because_interpret_true_clamps():
        out = pl.pallas_call(shift, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                             grid=(2,), in_specs=[pl.BlockSpec((8,), lambda i: (0,))],
                             out_specs=pl.BlockSpec((4,), lambda i: (i,)),
                             interpret=True)(jnp.arange(8.0))
        np.testing.assert_array_equal(out, [1, 2, 3, 4, 4, 5, 6, 7])

      def test_last_parallel_point_wins_only_in_interpret_true():
        from jax.experimental.pallas import tpu as pltpu
        out = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                             out_shape=jax.ShapeDtypeStruct((2,), jnp.float32), grid=(2,),
                             in_specs=[pl.BlockSpec((2,), lambda i: (i,))],
                             out_specs=pl.BlockSpec((2,), lambda i: (0,)),
                             compiler_params=pltpu.CompilerParams(
                                 dimension_semantics=("parallel",)),
                             interpret=True)(jnp.arange(4.0))
        np.testing.assert_array_equal(out, [2, 3])
      """))
  res = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
              "pallas_np.pytest_plugin", "--pallas-numpy-races", "test_kernels.py"],
             tmp_path, env_extra={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
  out = res.stdout + res.stderr
  assert "2 failed, 1 passed" in out, out
  assert "Pallas kernel 'shift' at grid point (1,)" in out and "out-of-bounds" in out
  assert "data race on outputs" in out


def test_debug_callback_gets_numpy_values_in_grid_order():
  seen = []

  def kernel(x_ref, o_ref):
    jax.debug.callback(lambda i, v: seen.append((int(i), type(v).__name__, v.tolist())),
                       pl.program_id(0), x_ref[...])
    o_ref[...] = x_ref[...]

  jax.block_until_ready(pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.int32), grid=(2,),
      in_specs=[pl.BlockSpec((2,), lambda i: (i,))],
      out_specs=pl.BlockSpec((2,), lambda i: (i,)), interpret="numpy")(
          jnp.arange(4, dtype=jnp.int32)))
  assert seen == [(0, "ndarray", [0, 1]), (1, "ndarray", [2, 3])]


def test_failure_mid_grid_leaves_aliased_input_untouched():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
    o_ref[pl.ds(pl.program_id(0) * 3, 2)] = x_ref[pl.ds(0, 2)]  # BUG at i=1: [3:5] of 4

  call = pallas_np.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
      out_specs=pl.BlockSpec((4,), lambda i: (i,)), input_output_aliases={0: 0})
  x = np.arange(8.0, dtype=np.float32)
  with pytest.raises(IndexError, match=r"grid point \(1,\)"):
    call(x)
  np.testing.assert_array_equal(x, np.arange(8.0))


def test_pdb_in_fori_loop_body_binds_loop_names(monkeypatch, capsys):
  monkeypatch.setattr(sys, "stdin", io.StringIO("p (int(j), acc.tolist())\nc\n"))
  call = pallas_np.pallas_call(deep_loop_kernel,
                               out_shape=jax.ShapeDtypeStruct((2,), jnp.float32),
                               interpret=pallas_np.InterpretParams(pdb=True))
  with pytest.raises(IndexError):
    call(jnp.arange(8.0))
  # fails in the inner body at i=3, j=1 (start 7): acc holds i=0..2 and (3, 0)
  x = np.arange(8.0)
  acc = sum(x[i * 2 + j:i * 2 + j + 2] for i in range(3) for j in range(3)) + x[6:8]
  assert f"(1, {acc.tolist()})" in capsys.readouterr().out


# -- DMAs (TPU): bounds and races -------------------------------------------------
def dma_rows_kernel(x_hbm, o_hbm, buf, sem, *, src_shift, same_dst):
  i = pl.program_id(0)
  pltpu.sync_copy(x_hbm.at[pl.ds(i * 8 + src_shift, 8)], buf)  # BUG if src_shift > 0
  pltpu.sync_copy(buf, o_hbm.at[pl.ds(0 if same_dst else i * 8, 8)])


def dma_rows(interpret, *, src_shift=0, same_dst=False, semantics="parallel"):
  import functools
  return pl.pallas_call(
      functools.partial(dma_rows_kernel, src_shift=src_shift, same_dst=same_dst),
      out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
      compiler_params=pltpu.CompilerParams(dimension_semantics=(semantics,)),
      interpret=interpret)


X16 = np.arange(16 * 128, dtype=np.float32).reshape(16, 128)


def test_dma_slice_out_of_bounds_raises():
  with pytest.raises(IndexError) as info, pallas_np.kernel_errors():
    dma_rows("numpy", src_shift=1)(X16)
  assert info.value.program_ids == (1,) and info.value.primitive == "dma_start"
  assert "pl.ds(start=9, size=8) [9:17]" in str(info.value)
  assert _line_of(dma_rows_kernel, "BUG if src_shift") in info.value.source


def test_dma_writes_from_parallel_points_race():
  ok = dma_rows(RACES)(X16)  # disjoint rows: no race
  np.testing.assert_array_equal(np.asarray(ok), X16)
  with pytest.raises(pallas_np.RaceError, match=r"grid point \(1,\) writes element "
                     r"\(0, 0\) that grid point \(0,\) wrote"), pallas_np.kernel_errors():
    dma_rows(RACES, same_dst=True)(X16)  # both write rows 0:8
  # Sequential ("arbitrary") grid: the same writes are fine.
  dma_rows(RACES, same_dst=True, semantics="arbitrary")(X16)


def test_race_detection_under_megacore():
  params = pallas_np.InterpretParams(detect_races=True, num_cores=2)
  with pytest.raises(pallas_np.RaceError, match="both map its block"), \
      pallas_np.kernel_errors():
    one_block_for_all(params, PARALLEL)(jnp.arange(8.0))
