"""Conversation caches: versioned snapshots of a sequence's model state and their host-memory store."""
