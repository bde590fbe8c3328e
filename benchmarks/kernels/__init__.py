"""Kernel benches and routing sweeps (CUDA): ``python -m benchmarks.kernels.NAME --help`` from the
repository root; the sweeps write the routing tables `edmm/kernels/*_routes.json` load."""
