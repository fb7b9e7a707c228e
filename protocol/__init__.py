"""The router ↔ node protocol: the work a router sends to prefill and decode nodes, and what comes back."""
