"""The saver: sharded KV checkpoints with a merged manifest and an atomic commit.

The data path, and back:  table -> export rows -> shard format -> backend -> rank manifest
-> barrier -> merged manifest -> commit  (see :mod:`de_store.saver.core`).
"""

from de_store.saver import tf_hook as _tf_hook  # registers the TF checkpoint saver
from de_store.saver.api import SaveHandle, restore, save
from de_store.saver.filesystem_saver import FileSystemSaver

del _tf_hook

__all__ = ["FileSystemSaver", "SaveHandle", "restore", "save"]
