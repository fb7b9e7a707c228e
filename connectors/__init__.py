"""The KV transfer plane: two roles, their transports, the Redis directory, and the connector contract.

Glossary (the code uses these words, and only these, for these things):

- **prefill node / decode node**: the two server processes (prefill_node/, decode_node/).
- **producer / consumer**: the transfer plane's two roles. A prefill node's producer
  (producer.py) holds computed KV and serves it; a decode node's consumer (consumer.py)
  learns where a request's KV is and pulls it. Usable without any node (standalone.py).
- **request**: one completion, named by its request id everywhere (router, nodes, directory).
- **block**: `block_size` tokens' K and V for every layer, the pool's unit (a block id).
- **run**: blocks consecutive on both sides of a pull, moved as one piece.
- **piece**: one buffer a transport moves (a run of one pool plane, or a hidden-states tensor).
- **location** (`wire.KVLocation`): where a request's KV and hidden states lie on its producer:
  block ids, layout, the transports it is offered over.
- **transport** (a `ConnectorKind`: ucx, tcp, shm, nccl, auto): how bytes move. Each has a
  folder with `send_engine.py` (the producer's half, run by a transfer server),
  `puller.py` (the consumer's half) and `transport.py` (makes both; transport.py here).
- **transport address**: the bytes a transport reaches a peer by (a UCX worker address,
  TCP `host:port`, a consumer's token); consumers publish theirs in the directory.
- **control endpoint**, or **endpoint**: a zmq URL a process takes control messages on: a
  node's work endpoint, a router's reply endpoint, a producer's side channel.
- **pull**: a consumer asks a producer (`PullRequest` on its side channel) to move a
  request's blocks into the consumer's blocks; the transfer server answers it.
- **release**: the producer no longer needs a request's blocks (pulled, refused, expired):
  the held table (held.py), their one owner, hands them back.
- **epoch**: a node incarnation's number, higher at each restart; the directory refuses
  locations an older incarnation publishes (fencing).
- **connector**: the contract the engine's runner calls (base.py): send after a prompt's
  forward, receive before it; connector.py builds it from a role.
"""
