"""The disaggregated vLLM pair the tests start: kvwire.cluster.vllm_pd, under the names the tests use."""

from __future__ import annotations

from kvwire.cluster.vllm_pd import DTYPE, PDCluster, pd_cluster, start_router

__all__ = ["DTYPE", "PDCluster", "pd_cluster", "start_router"]
