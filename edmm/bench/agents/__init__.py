"""The agent-workload bench: many concurrent sessions replayed from a trace under KV policies
(`edmm bench agents`). Modules: `trace` (format, JSONL, generator), `policies` (registry),
`replay` (the in-process driver), `http` (the same over `edmm serve`), `matrix` (sizing and
the run matrix), `report` (tables, plots), `engine_io` (the only reach past `AgentEngine`'s
public methods)."""
