"""The KV transfer plane: the connector contract, its two roles, the directory, the control plane, transports.

File map (folder, then file: what it holds). A word in **bold** is the glossary's: the code uses it,
and only it, for that thing.

- Here, the contract and what builds it:
  - base.py: the **connector** contract the engine's runner calls (vLLM's classic KV connector);
    connector.py: its two faces, one per role; types.py, model_input.py: the contract's data types;
    kv_pool.py: a node's paged KV **pool** (a **block** is `block_size` tokens of every layer's K and V);
    hidden.py: hidden states per request; checkpoint.py: a checkpoint's files and its **fingerprint**;
    prompt.py: a prompt's **fingerprint** (which tokens a location's KV is of).
  - config.py: the one frozen `ConnectorConfig`; factory.py: a **transport** by name;
    standalone.py: a role with no node around it; self_test.py: a node's start-up transport self-test.
  - wire.py: the transfer plane's messages (tagged msgspec structs) and the envelope with the wire version
    that every message rides in; the router ↔ node work messages are kvwire.protocol's (protocol/work.py).
  - deferred.py, wakeup.py: calls run a little later on a thread of their own; a wake-up fd (and `Mailbox`,
    what other threads tell a loop); spin.py: polling a peer without starving it.
- producer/: the **producer** role (role.py) a prefill node runs: it holds a computed prompt's KV
  (held.py, the **held table**, the blocks' one owner until their **release**), publishes its
  **location** (in the directory, and straight to the consumer the router named as a **KVReady**:
  `_send_kv_ready`), and answers **pulls** in a transfer server per transport (transfer_server.py);
  layer_gate.py: how far a layer-wise prefill has got; incarnations.py: its first directory act.
- consumer/: the **consumer** role (role.py) a decode node runs: it learns a request's location
  (expected.py; from a KVReady in its own inbox, inbox.py, or the directory, whichever comes first), waits on
  the directory for every expected request in one thread (watcher.py), checks the location fits its pool
  (fit.py), pulls it, and says what it moved or why not (errors.py); producer_watch.py: KV a dead producer
  owed is given up at once; fast_path.py: no silent slow path on one host.
- directory/: the Redis **directory** (`KVDirectory`, directory.py: request entries and their locations; nodes.py:
  the node registry; connection.py: the one Redis connection both use), with batch.py
  (many requests in one round trip), scripts.py (its atomic steps), heartbeat.py (a node's
  registration), redis_url.py (how to reach Redis) and advertise.py (the address a node publishes).
- control/: **control endpoints** (zmq URLs a process takes control messages on) and what crosses
  them: sockets.py, framing.py, auth.py (HMAC when a secret is set), side_channel.py (a consumer's
  end of producers' **side channels**, where a `PullRequest` goes).
- transports/: how bytes move, importing nothing of the roles above. transport.py: the contract every
  transport implements, `Transport`, a producer's half (a **send engine**, given `SendJob`s and the
  `Claims` it reports them to) and a consumer's half (a puller); offers.py: which of a producer's
  transports a consumer pulls over; kv_region.py: the pool as bytes, a request's
  blocks as **pieces** (one buffer a transport moves; a **run** is blocks consecutive on both
  sides, moved as one piece); block_copy.py, data_path.py, host.py, kv_checksum.py. One folder
  per transport (a `ConnectorKind`: ucx/, tcp/, shm/, nccl/, auto/), each with send_engine.py,
  puller.py and transport.py. A **transport address** is the bytes a transport reaches a peer by.
  Shared memory's **hold word** (shm/hold_board.py) says a request's blocks are still held.
- vllm/: the vLLM V1 KV connector (`kvwire.connectors.vllm`), over the same roles and transports.

Other words: **prefill node / decode node** are the two server processes (prefill_node/,
decode_node/); a **request** is one completion, named by its request id everywhere; an **epoch** is a
node incarnation's number, higher at each restart (the directory refuses an older one's locations).
"""
