"""Host-side scheduling: block pool, KV cache manager, scheduler. Never imports jax."""
