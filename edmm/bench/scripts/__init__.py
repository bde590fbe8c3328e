"""One-off measurement scripts (profiles, A/B checks, the vLLM comparisons) that wrote files of
``benchmarks/results``; run each with ``python -m edmm.bench.scripts.NAME --help``."""
