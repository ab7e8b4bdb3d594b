"""pd-router: prefill/decode disaggregation router for vLLM engines."""

__version__ = "0.1.0"
