"""KV transfer through memory shared on one host: the consumer reads the producer's blocks.

The producer's KV pool lives in an anonymous memfd (CUDA: device memory exported by
IPC handle); consumers receive it over the producer's private Unix socket and copy each
run of blocks straight into their own pool, so every KV byte is copied once. A pull:

1. The consumer reads the blocks as soon as the request is READY.
2. It asks the producer over the Unix socket to confirm (`PullRequest`: "I read these").
3. The confirmation (`PullReply` ok: the request was still held, so its blocks were not
   reused during the read) brings the hidden states along in a sealed memfd.

One round trip per pull; the zmq side channel carries nothing here.

- `segment.py`: the producer's memfd pool, the consumer's read-only mapping, hidden-state memfds
- `cuda_ipc.py`: the same for CUDA pools (run on one H100: README, Known limits)
- `channel.py`: the private socket directory, stale-socket cleanup, one message per packet
- `send_engine.py`: the producer's send engine; `puller.py`: the consumer's puller
- `transport.py`: the transport that puts them together
"""
