"""The HTTP front door: an OpenAI-compatible completions API over the prefill/decode pools."""
