"""The table core suite on MutableTable."""

from __future__ import annotations

from de_store.tables import MutableTable
from de_store.testing.table_suite import TableCoreTests


class TestMutableTable(TableCoreTests):
    def make_table(self, key_dtype, value_dtype, dim, name):
        return MutableTable(key_dtype, value_dtype, dim, name=name)
