"""Simulated vLLM engine (pd-sim-engine)."""
