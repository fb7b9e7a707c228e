"""Operations: Prometheus metrics, the nodes' health/readiness/metrics endpoint, `kvwire status`."""
