"""The Redis directory: where each request's KV lives, which nodes are alive, and how to reach Redis."""
