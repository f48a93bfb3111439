"""Eviction policies: the base and its view of the cache (:mod:`.base`), the registry (:mod:`.registry`), one file
per policy."""
