"""pallas_np.torch: every entry point against a torch/NumPy reference."""
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install 'pallas-np[torch]'); "
    "CI installs it, so these tests run there")
import torch.nn.functional as F  # noqa: E402

import pallas_np  # noqa: E402
import pallas_np.torch as pt  # noqa: E402


def _close(got, want, rtol=1e-5, atol=1e-5):
  assert got.shape == want.shape, (got.shape, want.shape)
  assert got.dtype == want.dtype, (got.dtype, want.dtype)
  torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


# -- optional extra -------------------------------------------------------------
def test_import_without_torch_says_how_to_install(monkeypatch):
  for name in [m for m in sys.modules if m == "pallas_np.torch" or m.startswith("pallas_np.torch.")]:
    monkeypatch.delitem(sys.modules, name)
  monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
  with pytest.raises(ImportError, match=r"pip install 'pallas-np\[torch\]'"):
    import pallas_np.torch  # noqa: F401


# -- conversion -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                   torch.int32, torch.uint8, torch.bool,
                                   torch.float8_e4m3fn])
def test_conversion_shares_memory_and_keeps_bits(dtype):
  src = (torch.randn(4, 6) * 3).to(dtype)
  arr = pt.to_numpy(src)
  assert arr.shape == (4, 6)
  assert arr.dtype == pt.torch_dtype_to_numpy(dtype)
  assert arr.__array_interface__["data"][0] == src.data_ptr()  # zero-copy in
  back = pt.to_torch(arr)
  assert back.dtype == dtype and back.data_ptr() == src.data_ptr()  # zero-copy out
  assert torch.equal(back.view(torch.uint8) if dtype.itemsize == 1 else back, src.view(torch.uint8) if dtype.itemsize == 1 else src)
  if dtype == torch.bfloat16:  # the values, not just the bits, are bf16
    np.testing.assert_array_equal(arr.astype(np.float32), src.float().numpy())


def test_conversion_of_strided_views():
  base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
  view = base.t()[1:4]
  arr = pt.to_numpy(view)
  np.testing.assert_array_equal(arr, view.numpy())
  assert np.shares_memory(arr, base.numpy())


# -- make_kernel_from_pallas ---------------------------------------------------------
def add_vectors_kernel(x_ref, y_ref, o_ref):
  x, y = x_ref[...], y_ref[...]
  o_ref[...] = x + y


@jax.jit
def add_vectors(x, y):
  return pl.pallas_call(add_vectors_kernel,
                        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_make_kernel_from_pallas_seed_example(dtype):
  q = (torch.randn(3, 2, 128, 4) * 4).to(dtype)
  k = (torch.randn(3, 2, 128, 4) * 4).to(dtype)
  pt_kernel = pt.make_kernel_from_pallas(add_vectors, lambda x, y: [(x.shape, x.dtype)])
  out = pt_kernel(q, k)
  assert isinstance(out, torch.Tensor)
  _close(out, q + k, rtol=0, atol=0)


def _scaled_kernel(x_ref, o_ref, s_ref, *, scale):
  o_ref[...] = x_ref[...] * scale
  s_ref[...] = jnp.sum(x_ref[...], axis=1, keepdims=True)


def scale_and_rowsum(x, scale):
  return pl.pallas_call(
      lambda x_ref, o_ref, s_ref: _scaled_kernel(x_ref, o_ref, s_ref, scale=scale),
      out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((x.shape[0], 1), jnp.float32)),
      grid=(2,), in_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0))],
      out_specs=(pl.BlockSpec((8, 16), lambda i: (i, 0)),
                 pl.BlockSpec((8, 1), lambda i: (i, 0))))(x)


def test_make_kernel_from_pallas_static_args_and_several_outputs():
  x = torch.randn(16, 16)
  kernel = pt.make_kernel_from_pallas(
      scale_and_rowsum, lambda x, s: [(x.shape, x.dtype), ((x.shape[0], 1), torch.float32)])
  out, rows = kernel(x, 3.0, static_argnums=(1,))
  _close(out, x * 3.0)
  _close(rows, x.sum(1, keepdim=True), rtol=1e-5, atol=1e-5)
  out2, _ = kernel(x, 0.5)  # another static value: another trace
  _close(out2, x * 0.5)


def test_make_kernel_from_pallas_checks_declared_outputs():
  kernel = pt.make_kernel_from_pallas(add_vectors, lambda x, y: [(x.shape, torch.float16)])
  with pytest.raises(ValueError, match="declared"):
    kernel(torch.ones(8), torch.ones(8))


def test_outputs_never_alias_inputs():
  kernel = pt.make_kernel_from_pallas(lambda x: x.reshape(-1), lambda x: [((8,), x.dtype)])
  x = torch.ones(2, 4)
  out = kernel(x)
  out.add_(1)
  assert torch.equal(x, torch.ones(2, 4))


# -- flash attention ---------------------------------------------------------------
def _attention_reference(q, k, v, causal, sm_scale, ab=None, q_seg=None, kv_seg=None):
  s = q.float() @ k.float().transpose(-1, -2)
  if ab is not None:
    s = s + ab.float()
  s = s * sm_scale  # the JAX kernel scales the bias too
  mask = torch.zeros(s.shape[-2:], dtype=torch.bool)
  if causal:
    mask = torch.ones_like(mask).triu(1)
  mask = mask.expand(s.shape)
  if q_seg is not None:
    mask = mask | (q_seg[:, None, :, None] != kv_seg[:, None, None, :])
  s = s.masked_fill(mask, float("-inf"))
  return (torch.softmax(s, -1) @ v.float()).to(q.dtype)


# Several q and kv blocks (the kernel needs kv blocks of 128 when there are several).
_SMALL_BLOCKS = [64, 128, 128, 1, 64, 128, 128, 64, 128, 128, 64]


def _qkv(shape, dtype=torch.float32, seed=0):
  g = torch.Generator().manual_seed(seed)
  return [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_forward_and_autograd(causal):
  q, k, v = [t.requires_grad_() for t in _qkv((2, 1, 256, 32))]
  out = pt.flash_attention(q, k, v, causal=causal, sm_scale=0.3, block_sizes=_SMALL_BLOCKS)
  ref = _attention_reference(q, k, v, causal, 0.3)
  _close(out, ref, rtol=1e-5, atol=2e-6)
  grad = torch.randn_like(out)
  got = torch.autograd.grad(out, (q, k, v), grad)
  want = torch.autograd.grad(ref, (q, k, v), grad)
  for g, w in zip(got, want):
    _close(g, w, rtol=1e-4, atol=2e-5)


def test_flash_attention_bias_segments_and_their_gradients():
  q, k, v = [t.requires_grad_() for t in _qkv((1, 2, 256, 32), seed=1)]
  ab = torch.randn(1, 2, 256, 256, requires_grad=True)
  q_seg = torch.tensor([[0] * 100 + [1] * 156])
  kv_seg = torch.tensor([[0] * 60 + [1] * 196])
  out = pt.flash_attention(q, k, v, False, q_seg, kv_seg, 0.5, ab=ab, block_sizes=_SMALL_BLOCKS)
  ref = _attention_reference(q, k, v, False, 0.5, ab, q_seg, kv_seg)
  _close(out, ref, rtol=1e-5, atol=2e-6)
  got = torch.autograd.grad(out.square().sum(), (q, k, v, ab))
  want = torch.autograd.grad(ref.square().sum(), (q, k, v, ab))
  for g, w in zip(got, want):
    _close(g, w, rtol=1e-4, atol=5e-5)


def test_flash_attention_bf16_default_blocks():
  q, k, v = _qkv((1, 1, 128, 64), torch.bfloat16, seed=2)
  out = pt.flash_attention(q, k, v, causal=True)
  assert out.dtype == torch.bfloat16
  _close(out.float(), _attention_reference(q, k, v, True, 1.0).float(), rtol=2e-2, atol=2e-2)


def test_flash_attention_in_torch_compile_graph_is_one_opaque_op():
  from torch._dynamo.testing import CompileCounterWithBackend
  q, k, v = [t.requires_grad_() for t in _qkv((1, 1, 256, 32), seed=3)]

  def loss(q, k, v):
    return (pt.flash_attention(q, k, v, causal=True, block_sizes=_SMALL_BLOCKS) * 2).sum()

  counter = CompileCounterWithBackend("aot_eager")
  compiled = torch.compile(loss, backend=counter, fullgraph=True)
  value = compiled(q, k, v)
  got = torch.autograd.grad(value, (q, k, v))
  targets = [n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
  assert torch.ops.pallas_np.flash_attention.default in targets or \
      torch.ops.pallas_np.flash_attention in targets, targets
  ref = (_attention_reference(q, k, v, True, 1.0) * 2).sum()
  want = torch.autograd.grad(ref, (q, k, v))
  torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-4)
  for g, w in zip(got, want):
    _close(g, w, rtol=1e-4, atol=5e-5)


def test_custom_ops_pass_torch_opcheck():
  q, k, v = _qkv((1, 1, 256, 32), seed=4)
  args = (q, k, v, None, None, None, True, 0.5, _SMALL_BLOCKS)
  torch.library.opcheck(torch.ops.pallas_np.flash_attention.default, args,
                        test_utils=("test_schema", "test_faketensor",
                                    "test_autograd_registration"))


# -- paged attention ---------------------------------------------------------------
def _paged_reference(q, k_pages, v_pages, lengths, page_indices):
  batch, heads, dim = q.shape
  kv_heads, _, page_size, _ = k_pages.shape
  group = heads // kv_heads
  out = torch.empty_like(q)
  for b in range(batch):
    n = int(lengths[b])
    pages = page_indices[b]
    # The kernel reads K and V pages as bfloat16 (MultiPageAsyncCopyDescriptor
    # ._maybe_dequantize), so the reference rounds them the same way.
    k = k_pages[:, pages].reshape(kv_heads, -1, dim)[:, :n].bfloat16().float()
    v = v_pages[:, pages].reshape(kv_heads, -1, dim)[:, :n].bfloat16().float()
    for h in range(heads):
      s = k[h // group] @ q[b, h]
      out[b, h] = torch.softmax(s, -1) @ v[h // group]
  return out


def test_paged_attention_matches_reference():
  g = torch.Generator().manual_seed(5)
  batch, heads, kv_heads, dim, pages, page_size, per_seq = 2, 4, 2, 128, 12, 16, 4
  q = torch.randn(batch, heads, dim, generator=g)
  k_pages = torch.randn(kv_heads, pages, page_size, dim, generator=g)
  v_pages = torch.randn(kv_heads, pages, page_size, dim, generator=g)
  lengths = torch.tensor([37, 64])
  page_indices = torch.randperm(pages, generator=g)[:batch * per_seq].reshape(batch, per_seq)
  out = pt.paged_attention(q, k_pages, v_pages, lengths, page_indices,
                           pages_per_compute_block=2)
  _close(out, _paged_reference(q, k_pages, v_pages, lengths, page_indices),
         rtol=1e-5, atol=1e-5)
  compiled = torch.compile(
      lambda *a: pt.paged_attention(*a, pages_per_compute_block=2) + 1,
      backend="aot_eager", fullgraph=True)  # one opaque op, no graph break
  _close(compiled(q, k_pages, v_pages, lengths, page_indices), out + 1, rtol=0, atol=0)


def test_paged_attention_fake_gives_shapes():
  from torch._subclasses.fake_tensor import FakeTensorMode
  with FakeTensorMode():
    q = torch.empty(2, 4, 128)
    pages = torch.empty(2, 12, 16, 128)
    out = pt.paged_attention(q, pages, pages, torch.empty(2, dtype=torch.int32),
                             torch.empty(2, 4, dtype=torch.int32), 2)
  assert out.shape == (2, 4, 128) and out.dtype == torch.float32


# -- torch_pallas_call ----------------------------------------------------------------
def test_seed_000_example_unchanged():
  """Seed 000's example, verbatim apart from the imports."""
  from pallas_np.torch import torch_pallas_call, interop
  import pallas_np.torch.jax_device  # noqa: F401  (device='jax')

  def add_vectors_kernel(x_ref, y_ref, o_ref):
    x, y = x_ref[...], y_ref[...]
    o_ref[...] = torch.add(x, y)  # <-- here I use torch.add instead of + to show case it's really a torch op

  def add_vectors(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch_pallas_call(
        add_vectors_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, interop.jax_view(x.dtype)),
        interpret=True
    )(x, y)

  x, y = torch.randn(8, device='jax'), torch.randn(8, device='jax')
  result = add_vectors(x, y)
  _close(result, x + y, rtol=0, atol=0)


def mlp_kernel(x_ref, w_ref, b_ref, o_ref, stats_ref):
  h = F.gelu(x_ref[...] @ w_ref[...] + b_ref[...], approximate="tanh")
  top = h.max(dim=-1, keepdim=True)
  o_ref[...] = torch.softmax(h - top.values, dim=-1)
  stats_ref[...] = torch.stack([h.mean(1), h.std(1), top.indices.squeeze(1).float()], 1)


def test_torch_pallas_call_grid_blockspecs_and_several_outputs():
  g = torch.Generator().manual_seed(6)
  x, w, b = torch.randn(32, 16, generator=g), torch.randn(16, 8, generator=g), torch.randn(8, generator=g)
  call = pt.torch_pallas_call(
      mlp_kernel, out_shape=(torch.empty(32, 8), torch.empty(32, 3)), grid=(4,),
      in_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0)), pl.BlockSpec((16, 8), lambda i: (0, 0)),
                pl.BlockSpec((8,), lambda i: (0,))],
      out_specs=(pl.BlockSpec((8, 8), lambda i: (i, 0)), pl.BlockSpec((8, 3), lambda i: (i, 0))))
  out, stats = call(x, w, b)
  h = F.gelu(x @ w + b, approximate="tanh")
  top = h.max(dim=-1, keepdim=True)
  _close(out, torch.softmax(h - top.values, -1), rtol=1e-5, atol=1e-6)
  _close(stats, torch.stack([h.mean(1), h.std(1), top.indices.squeeze(1).float()], 1),
         rtol=1e-5, atol=1e-5)


def accumulate_kernel(x_ref, o_ref):
  @pl.when(pl.program_id(0) == 0)
  def _():
    o_ref[...] = torch.zeros(o_ref.shape)
  o_ref[...] += x_ref[...].sum(0, keepdim=True)
  o_ref[0, 0:2] = torch.tensor([7.0, 8.0]) * o_ref[0, 2:4]


def test_torch_pallas_call_program_id_when_and_factories():
  x = torch.randn(4, 8, 8)
  call = pt.torch_pallas_call(
      accumulate_kernel, out_shape=torch.empty(1, 8), grid=(4,),
      in_specs=[pl.BlockSpec((None, 8, 8), lambda i: (i, 0, 0))],
      out_specs=pl.BlockSpec((1, 8), lambda i: (0, 0)))
  want = torch.zeros(1, 8)
  for i in range(4):
    want = want + x[i].sum(0, keepdim=True)
    want[0, 0:2] = torch.tensor([7.0, 8.0]) * want[0, 2:4]
  _close(call(x), want, rtol=1e-5, atol=1e-5)


def prefetch_loop_kernel(idx_ref, x_ref, o_ref, acc_ref):
  acc_ref[...] = torch.zeros(acc_ref.shape)

  def body(i, count):
    acc_ref[...] += x_ref[...] * (i + 1)
    return count + 1  # a JaxTensor carry
  count = jax.lax.fori_loop(0, 3, body, torch.tensor(0))
  o_ref[...] = acc_ref[...] + count


def test_torch_pallas_call_scalar_prefetch_scratch_and_fori_loop():
  from jax.experimental.pallas import tpu as pltpu
  x = torch.randn(4, 8, 128)
  idx = torch.tensor([3, 1, 0, 2], dtype=torch.int32)
  call = pt.torch_pallas_call(
      prefetch_loop_kernel, out_shape=torch.empty(4, 8, 128),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(4,),
          in_specs=[pl.BlockSpec((None, 8, 128), lambda i, idx: (idx[i], 0, 0))],
          out_specs=pl.BlockSpec((None, 8, 128), lambda i, idx: (i, 0, 0)),
          scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)]))
  _close(call(idx, x), x[idx.long()] * 6 + 3, rtol=1e-6, atol=1e-6)


def window_kernel(off_ref, x_ref, o_ref):
  o_ref[...] = x_ref[pl.ds(off_ref[0], 8), :]  # a torch-side value as pl.ds start

  @pl.when(pt.interop.jax_view(o_ref[...].sum() > 0))  # predicates must be JAX values
  def _():
    o_ref[...] = -o_ref[...]


@pytest.mark.parametrize("offset", [0, 5, 24])
def test_torch_pallas_call_smem_dynamic_slice_and_when(offset):
  from jax.experimental.pallas import tpu as pltpu
  x = torch.randn(32, 128, generator=torch.Generator().manual_seed(offset))
  call = pt.torch_pallas_call(
      window_kernel, out_shape=torch.empty(8, 128),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec((32, 128), lambda: (0, 0))])
  want = x[offset:offset + 8]
  want = -want if want.sum() > 0 else want
  _close(call(torch.tensor([offset], dtype=torch.int32), x), want, rtol=0, atol=0)


# One line per covered op family: the same torch function runs inside a kernel
# (mapped onto JAX) and eagerly in torch; the results must agree.
_OP_CASES = {
    "arith": lambda a, b: torch.sub(a, b, alpha=2) * 3 - a / (b.abs() + 1) + a ** 2 - (1 - a),
    "div_modes": lambda a, b: torch.div(a, b + 3, rounding_mode="floor") + torch.div(a, b + 3, rounding_mode="trunc"),
    "minmax": lambda a, b: torch.maximum(a, b) + torch.minimum(a, b).clamp(-0.5, 0.5) + torch.max(a, b),
    "unary": lambda a, b: a.exp().log1p() + torch.sin(a) * torch.cos(b) + torch.tanh(a) + torch.rsqrt(b.abs() + 1),
    "activations": lambda a, b: F.relu(a) + F.silu(b) + F.gelu(a) + torch.sigmoid(b) + F.leaky_relu(a, 0.1) + F.softplus(b),
    "compare_where": lambda a, b: torch.where(a > b, a, b * 2) + (a <= 0).float() + torch.eq(a, a).to(torch.float32),
    "reductions": lambda a, b: a.sum(0, keepdim=True) + b.mean(1, keepdim=True) + a.amax(1, keepdim=True) + torch.logsumexp(b, 1, keepdim=True),
    "softmax": lambda a, b: torch.softmax(a, -1) + F.log_softmax(b, dim=0),
    "cumsum_var": lambda a, b: torch.cumsum(a, 1) + b.var(1, keepdim=True) + b.std(0, keepdim=True, correction=0),
    "argmax": lambda a, b: (a.argmax(1, keepdim=True) + torch.argmin(b, dim=0, keepdim=True)).float(),
    "matmul": lambda a, b: a @ b.T + torch.matmul(a, b.t()) + torch.einsum("ij,kj->ik", a, b) + torch.mm(a, b.transpose(0, 1)),
    "shapes": lambda a, b: a.reshape(2, 4, 8).permute(1, 0, 2).flatten(1).T[:, :8].contiguous().view(8, 8) + b.unsqueeze(0).squeeze(0),
    "cat_split": lambda a, b: torch.cat(torch.split(a, 4, dim=1)[::-1], dim=1) + torch.stack([a, b]).sum(0),
    "expand_repeat": lambda a, b: a[:, :1].expand(8, 8) + b[:1].repeat(8, 1) + torch.flip(a, [0]) + torch.roll(b, 1, 1),
    "triangles": lambda a, b: torch.tril(a) + torch.triu(b, 1),
    "indexing": lambda a, b: a[::2].repeat(2, 1) + b[None, 3, :] + a[..., 2:3],
    "factories": lambda a, b: a + torch.ones(8, 8) * 2 + torch.arange(8).float() + torch.full((8, 1), 0.5) + torch.zeros_like(b) + torch.eye(8),
    "dtypes": lambda a, b: (a * 100).int().float() + (b * 10).to(torch.int32).to(torch.float32) + a.bfloat16().float(),
    "inplace": lambda a, b: a.clone().mul_(2).add_(b).clamp_(-1, 1),
    "bitwise": lambda a, b: ((a > 0) & (b > 0) | ~(a < -1)).float() + (((a * 10).int() >> 1) ^ 3).float(),
}


@pytest.mark.parametrize("name", sorted(_OP_CASES))
def test_torch_ops_in_kernel_match_torch(name):
  fn = _OP_CASES[name]
  g = torch.Generator().manual_seed(7)
  a, b = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = fn(a_ref[...], b_ref[...])

  want = fn(a, b)
  got = pt.torch_pallas_call(kernel, out_shape=want)(a, b)
  _close(got, want, rtol=2e-5, atol=2e-5)


def test_bf16_kernel_with_torch_ops():
  a = torch.randn(16, 128).bfloat16()

  def kernel(a_ref, o_ref):
    o_ref[...] = (a_ref[...].float() * 2).bfloat16()

  got = pt.torch_pallas_call(kernel, out_shape=a)(a)
  _close(got, (a.float() * 2).bfloat16(), rtol=0, atol=0)


def test_uncovered_torch_op_names_the_op_and_the_kernel_line():
  def kernel(x_ref, o_ref):
    o_ref[...] = torch.fft.fft(x_ref[...]).real  # not mapped

  with pytest.raises(pallas_np.UnsupportedError) as info:
    pt.torch_pallas_call(kernel, out_shape=torch.empty(8))(torch.randn(8))
  assert isinstance(info.value, NotImplementedError)
  msg = str(info.value)
  assert "'torch.fft.fft'" in msg and "test_torch.py:" in msg, msg


def test_special_namespace_ops_map_too():
  a = torch.randn(8)

  def kernel(a_ref, o_ref):
    o_ref[...] = torch.special.expit(a_ref[...]) + torch.special.erf(a_ref[...])

  _close(pt.torch_pallas_call(kernel, out_shape=a)(a), torch.special.expit(a) + torch.special.erf(a))


def test_torch_compile_runs_generic_kernels_after_a_graph_break():
  kernel = pt.make_kernel_from_pallas(add_vectors, lambda x, y: [(x.shape, x.dtype)])
  compiled = torch.compile(lambda x: kernel(x * 2, x) + 1, backend="aot_eager")
  x = torch.randn(8)
  _close(compiled(x), x * 3 + 1)

  def relu_kernel(a_ref, o_ref):
    o_ref[...] = torch.relu(a_ref[...])
  built_inside = torch.compile(
      lambda x: pt.torch_pallas_call(relu_kernel, out_shape=x)(x) * 2, backend="aot_eager")
  _close(built_inside(x), torch.relu(x) * 2)


def test_make_kernel_from_pallas_on_strided_views():
  base = torch.randn(16, 32)
  x, y = base.t(), base[:, ::2].t().repeat(2, 1)  # (32, 16) views, non-contiguous
  kernel = pt.make_kernel_from_pallas(add_vectors, lambda x, y: [(x.shape, x.dtype)])
  _close(kernel(x, y), x + y, rtol=0, atol=0)


def test_interop_views():
  assert pt.interop.jax_view(torch.bfloat16) == jnp.bfloat16
  assert pt.interop.torch_view(jnp.dtype(jnp.int8)) == torch.int8
  t = pt.interop.torch_view(jnp.arange(4, dtype=jnp.int32))
  assert torch.equal(t, torch.arange(4, dtype=torch.int32))
  doubled = pt.interop.torch_view(lambda x: x * 2)
  _close(doubled(torch.arange(3.0)), torch.arange(3.0) * 2)
