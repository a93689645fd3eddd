"""Refs: compiled ref transforms (indexing) and the read/write primitives."""
from pallas_np.state import indexing, refs, masked, atomics, run_state  # noqa: F401
