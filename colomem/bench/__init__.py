"""Microbenchmarks of GPU <-> host transfers: `python -m colomem.bench --help`."""
