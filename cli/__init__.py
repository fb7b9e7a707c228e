"""Command-line entry points and process helpers (thin layers over the library)."""
