"""Helpers of ``benchmarks/bench_peer_suites.py`` (issue 21: rewritten libraries must pass their own
test suites): outcome comparison, the timm test selection, the pytest plugin copied into each run,
and the transformers model testers."""
