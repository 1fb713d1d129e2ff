"""A TensorFlow server for the task ``TF_CONFIG`` names; serves until killed.

``server.py [PARK_WRITES_AT]``: with a byte count, no file this task writes grows past it.
A write beyond it raises the file-size limit's SIGXFSZ, whose handler (set here, in C:
``pause``) parks the writing thread until the process is killed: the task stops in the
middle of that write, for as long as a test needs to kill it there
(tests/distribute/test_ps_killed.py). Other threads go on.
"""

import ctypes
import resource
import signal
import sys

import tensorflow as tf


def park_writes_at(limit: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    # a C handler: a Python one would run only between bytecodes of the main thread, after
    # the write had already failed (EFBIG) on its own thread
    libc.signal(signal.SIGXFSZ, ctypes.cast(libc.pause, ctypes.c_void_p))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


config = None
if len(sys.argv) > 1:
    park_writes_at(int(sys.argv[1]))
    # the columns of a shard are written side by side; a parked one keeps its thread
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=8)
resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
server = tf.distribute.Server(
    resolver.cluster_spec(),
    job_name=resolver.task_type,
    task_index=resolver.task_id,
    protocol="grpc",
    config=config,
    start=True,
)
server.join()
