"""KV transfer over UCX (the `ucxx` package): tag messages between worker-address endpoints."""
