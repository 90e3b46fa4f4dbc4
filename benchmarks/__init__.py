"""On-demand benchmarks of the platform beside a bare reference (never part of the tests).

See ``benchmarks/README.md``.
"""
