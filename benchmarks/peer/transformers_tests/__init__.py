"""transformers peer suite: ``tests/`` is laid over the transformers sdist's ``tests/`` in each run
copy (``benchmarks/bench_peer_suites.py``); ``selection`` picks the tests of each subset."""
