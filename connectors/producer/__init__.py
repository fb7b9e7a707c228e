"""The producer role: hold a computed prompt's KV, publish where it is, serve pulls of it."""
