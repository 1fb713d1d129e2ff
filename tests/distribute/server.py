"""A TensorFlow server for the task ``TF_CONFIG`` names; serves until killed."""

import tensorflow as tf

resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
server = tf.distribute.Server(
    resolver.cluster_spec(),
    job_name=resolver.task_type,
    task_index=resolver.task_id,
    protocol="grpc",
    start=True,
)
server.join()
