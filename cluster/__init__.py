"""Tools that start and inspect a cluster: local clusters of kvwire nodes or vLLM servers, Redis, status."""
