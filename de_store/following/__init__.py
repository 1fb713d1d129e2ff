"""Serving follows training: :func:`follow` applies each newly committed checkpoint to a
serving process's live tables (see :mod:`de_store.following.follower`)."""

from de_store.following.follower import AppliedCheckpoint, Follower, follow

__all__ = ["AppliedCheckpoint", "Follower", "follow"]
