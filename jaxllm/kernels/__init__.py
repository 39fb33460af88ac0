"""Pallas ops for paged attention on NVIDIA GPUs, each with a plain-jnp reference.

Imports only jax and numpy. Shapes (dimension letters):
  T  tokens in the flattened (ragged) batch      S  sequences (padded bucket)
  Hq query heads   Hkv key/value heads   D head dim   P pages in the pool   PS page size (tokens)
  B  pages per sequence in the block table
"""
