"""A save still writing when its script ends is finished before the interpreter exits.

Python stops ``concurrent.futures`` from taking work before it runs ``atexit``: without
de_store's exit hook, the writers' thread pools refused work and the last checkpoint of a
script was lost (``de_store.save`` silently, TF's async save with an error at exit).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from saver_helpers import make_variable

import de_store as ds

ROWS = 1_000_000  # big enough that the write is still going on when the script ends

SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tensorflow as tf
    import de_store

    how, url = sys.argv[1], sys.argv[2]
    saver = de_store.FileSystemSaver()
    variable = de_store.get_variable(
        "emb", key_dtype=tf.int64, value_dtype=tf.float32, dim=16,
        kv_creator=de_store.HashTableCreator(saver=saver),
    )
    keys = np.arange({rows}, dtype=np.int64) * 7 + 1
    variable.upsert(keys, (keys[:, None] % 1000 + np.arange(16)).astype(np.float32))
    if how == "de_store.save":
        de_store.save([variable], url + "/kv")  # the handle is dropped: nobody waits
    else:
        options = tf.train.CheckpointOptions(enable_async=True)
        tf.train.Checkpoint(emb=variable).write(url + "/ckpt", options=options)
    """
).format(rows=ROWS)


@pytest.mark.parametrize("how", ["de_store.save", "tf_async_write"])
def test_the_last_save_of_a_script_is_committed(tmp_path, how):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, how, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]

    variable = make_variable("emb", ds.FileSystemSaver(), dim=16)
    if how == "de_store.save":
        ds.restore([variable], str(tmp_path / "kv"))
    else:
        status = tf.train.Checkpoint(emb=variable).read(str(tmp_path / "ckpt"))
        status.assert_existing_objects_matched()
    keys = np.arange(ROWS, dtype=np.int64) * 7 + 1
    values, exists = variable.lookup(keys, return_exists=True)
    assert bool(np.all(exists.numpy()))
    expected = (keys[:, None] % 1000 + np.arange(16)).astype(np.float32)
    np.testing.assert_array_equal(values.numpy(), expected)
    assert int(variable.size()) == ROWS
