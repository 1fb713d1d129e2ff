"""Table cores: key -> value-row storage that a ``de_store.Variable`` shards over devices."""

from de_store.tables.base import TableCore
from de_store.tables.hash_table import HashTable
from de_store.tables.mutable_table import MutableTable

__all__ = ["HashTable", "MutableTable", "TableCore"]
