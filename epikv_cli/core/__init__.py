"""The cache and what is read from the forward pass: budget cache storage, slot tables, per-head slots, taps.

Imports nothing of epikv_cli's but :mod:`epikv_cli.errors`; knows no policy."""
