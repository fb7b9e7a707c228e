"""The disaggregated vLLM pair the tests start: kvwire.cli.vllm_pd, under the names the tests use."""

from __future__ import annotations

from kvwire.cli.vllm_pd import DTYPE, PDCluster, pd_cluster, start_router

__all__ = ["DTYPE", "PDCluster", "pd_cluster", "start_router"]
