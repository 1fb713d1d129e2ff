"""Storage backends built on fsspec."""
