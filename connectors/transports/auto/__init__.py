"""`--connector auto`: shared memory with peers on the same host, UCX with the rest."""
