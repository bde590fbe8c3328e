"""The benchmarks of ``edmm bench``; each command's options and run are in `commands`.

- ``vmm``: `vmm` (the VMM layer's page and context operations);
- ``ttft``: `resume` (the A/B/C resume groups in the engine), `resume_peer` (the same groups
  through transformers), `model_ops` (decode step and prefills on the model directly) and
  `model_ops_engine` (the same through the engine, any tensor-parallel size);
- ``live``: `live` (the A/B/C groups at the client, over HTTP against ``edmm serve``);
- ``agents``, ``agents-merge``: `agents` (many agent sessions replayed from a trace under KV
  policies);
- shared: `results` (result files stamped with the environment, tables, plots) and `stats`.
"""
