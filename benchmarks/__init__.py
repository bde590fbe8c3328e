"""The lab beside the product (not in the wheel): one-off measurement scripts (`scripts`), kernel
benches and the sweeps that write `edmm/kernels/*_routes.json` (`kernels`); ``results/`` holds
what was measured. Run each from the repository root: ``python -m benchmarks.scripts.NAME``."""
