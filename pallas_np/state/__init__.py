"""Refs: compiled ref transforms (indexing) and the read/write primitives."""
from pallas_np.state import indexing, refs, masked, atomics  # noqa: F401
