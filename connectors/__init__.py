"""The KV transfer plane: the connector contract, its transports and the Redis directory."""
