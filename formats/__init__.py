"""Shard formats: Parquet, Arrow IPC, raw binary (TFRA layout)."""
