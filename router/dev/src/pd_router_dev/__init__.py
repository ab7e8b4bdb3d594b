"""Development-only code for pd-router: the simulated vLLM engine, the process stack used by
the demo, the benchmark and the end-to-end tests. Never imported by ``pd_router`` (ruff's
banned-api rule in router/pyproject.toml) and never in the router image (router/Dockerfile
copies router/src only)."""
