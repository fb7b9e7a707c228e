"""KV transfer over plain TCP sockets, for hosts with nothing better.

Two channels per producer/consumer pair:

- control: the framework's zmq side channel (`PullRequest` → `PullReply`), unchanged;
- data: one TCP connection per (consumer, producer), opened by the consumer and kept.

Addresses published in the directory:

- the producer's `transport_address` is its data listener, `b"host:port"`
  (`b"[v6addr]:port"` for IPv6);
- the consumer's `transport_address` is a random 16-byte token drawn once per
  process. The consumer presents it in the hello of every data connection, and the
  producer's transfer server accepts a pull only if the token in the `PullRequest` is
  the one that consumer published: so a pull's bytes go to the connection that showed
  the published token, never to whoever asked.

Data connection, all integers big-endian (`frames.py`):

    consumer → producer   HELLO  = b"kvwHELO1" + token[16]       once, on connect
    producer → consumer   ACK    = b"kvwACK01"                   once: the token is registered
    producer → consumer   HEADER = b"kvwDATA1" + transfer_id u64 + total_bytes u64
                          then total_bytes of payload: the pull's pieces back to back
                          (runs of blocks, plane by plane, then each hidden tensor)

The producer writes header + pieces with `sendmsg` straight from its KV blocks, the
consumer reads them with `recvmsg_into` straight into its destination blocks, both in
batches of at most IOV_MAX (1024) buffers advanced through partial calls: no staging
copy, and nothing proportional to the transfer size is allocated. CUDA tensors, which
sockets cannot address, pass through one fixed pinned buffer per connection, in chunks
of 8 MiB gathered or scattered by a few kernels each, the next chunk's device copy
running while the socket moves this one's (`stream.py`).

Files: `frames.py` (frames, addresses, socket options), `stream.py` (scatter/gather
cursor), `send_engine.py` (producer), `puller.py` (consumer), `transport.py` (the two together).
"""
