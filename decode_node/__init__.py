"""The decode node: receives prompts' KV, skips their forward, and generates tokens."""
