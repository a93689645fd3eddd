"""JAX's PRNG implementations (threefry), for the random primitives' rules."""
from jax._src.random import prng as jax_prng  # noqa: F401  (re-exported)
from jax._src.random import threefry2x32 as jax_threefry  # noqa: F401
