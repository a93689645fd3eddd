"""Control flow and calls: cond, while, scan, jit/closed_call/remat/custom
derivative calls. Sub-jaxprs are compiled once into plans by the same
compiler; refs pass through as the same NumPy arrays, so effects inside a
branch or loop body land where they should."""
from pallas_np.control_flow import conditionals, loops, calls  # noqa: F401
