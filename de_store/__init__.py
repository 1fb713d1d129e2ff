"""Dynamic embedding tables for TensorFlow with fast, safe checkpoints."""
