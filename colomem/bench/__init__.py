"""Microbenchmarks of GPU <-> host transfers (`python -m colomem.bench --help`) and, in `shapes`, the one
table of real model shapes that the benchmarks, the budget tool and the config-built models use."""
