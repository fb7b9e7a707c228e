"""The consumer role: learn where a request's KV is, pull it, report what it moved or why not."""
