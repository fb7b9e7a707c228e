"""KV transfer through memory shared on one host: the consumer reads the producer's blocks.

The producer's KV pool lives in an anonymous memfd (CUDA: device memory exported by
IPC handle); consumers receive it over the producer's private Unix socket and copy each
run of blocks straight into their own pool, so every KV byte is copied once. The
framework's zmq side channel grants each read (`PullReply` ok = "read now"); the Unix
socket carries the consumer's `PullDone` and the producer's confirmation, which brings
the hidden states along in a sealed memfd.

- `segment.py`: the producer's memfd pool, the consumer's read-only mapping, hidden-state memfds
- `cuda_ipc.py`: the same for CUDA pools (untested here: no GPU)
- `channel.py`: the private socket directory, stale-socket cleanup, one message per packet
- `engine.py`: the producer's send engine; `puller.py`: the consumer's puller
- `connector.py`: the connector that puts them together
"""
