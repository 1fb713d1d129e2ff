"""The checkpoint protocol, apart from TensorFlow: what a checkpoint is on storage and how
it is written, committed, found, checked and collected.

- :mod:`.names`: every file and folder name a save writes, with its parser;
- :mod:`.manifest`: the merged manifest and the rank manifests (JSON);
- :mod:`.variable_rows`, :mod:`.shards`: a variable's rows as numpy columns, and their
  shard files (bucketed by key hash, or in table order) written and read back;
- :mod:`.commit`: commit records and manifests committed atomically (rename or marker);
- :mod:`.barrier`, :mod:`.topology`, :mod:`.events`: the ranks of one save;
- :mod:`.request`, :mod:`.destination`: a save request checked once, where it enters
  (distinct variable names, a destination that can take the checkpoint);
- :mod:`.staging`, :mod:`.retry`, :mod:`.parallel`: what a save leaves while it writes,
  how storage calls are retried, and how calls that wait on storage are made side by side;
- :mod:`.chain`, :mod:`.checks`, :mod:`.buckets`, :mod:`.verify`: reading checkpoints back
  and checking them (incremental chains, shard records, key buckets, crc32c);
- :mod:`.gc`, :mod:`.binding`: what is abandoned or orphaned, and the TF checkpoint a
  KV checkpoint was saved for;
- :mod:`._tf_bundle`: the bytes of TensorFlow's bundle index, written without TensorFlow.

None of these modules imports TensorFlow: the tools that touch no table (``de-store
convert``, ``compact``, ``verify``, ``gc``, ``ls``) use this package only. The TensorFlow
side (tables to rows and back, the TF checkpoint hook) is :mod:`de_store.saver`.
"""
