"""What both node processes are made of: their runtime (model, pool, connector, work socket,
directory entry), their configuration, and their drain."""
