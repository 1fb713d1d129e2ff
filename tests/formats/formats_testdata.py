"""The shard rows the format tests share (they ship with de_store for the format suite)."""

from de_store.testing.shard_data import concat, make_keys, make_values, same

__all__ = ["concat", "make_keys", "make_values", "same"]
