"""Measurements that return records and never print: profile, max context, fidelity, eval, calibrate."""
