"""A small paged-KV inference engine for Llama-architecture models, shared by both nodes."""
