"""``python -m benchmarks``: list the benchmarks (see ``benchmarks/__init__.py``)."""

import benchmarks

print(benchmarks.__doc__)
