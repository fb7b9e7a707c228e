"""Benchmarks: what the transfer plane achieves, side by side with the machine's limits.

File map (file: what it holds, as its own docstring opens):

- bare_chain.py: The bare chain: `kvwire bench e2e`'s two modes with no kvwire in them, as a baseline for the TTFT
  gap.
- choices.py: What `kvwire bench transfer` can be asked for: methods, block placements, devices (no torch: the CLI
  imports it).
- connector_run.py: A connector moving the benchmark's work between two real processes.
- cpu.py: Where the machine's CPU went while a method's measured transfers ran (all cores, /proc/stat).
- directory.py: `kvwire bench directory`: the directory's throughput and latency against a real redis-server.
- e2e.py: `kvwire bench e2e`: the same prompt mix through the router, disaggregated and single-node.
- handoff.py: `kvwire bench handoff`: what taking turns with another process costs a prompt forward, with no kvwire
  in between.
- layerwise.py: `kvwire bench transfer --layerwise`: how much of the KV transfer hides behind prefill's compute.
- limits.py: The machine's limits on the same work: one process copying, and raw TCP with iovecs.
- load.py: `kvwire bench load`: many requests from many concurrent clients through the router.
- node_listing.py: `kvwire bench directory --nodes N`: what listing the live nodes costs Redis and a router, in a
  fleet.
- memory.py: Peak memory a process uses beyond what it held when measuring started (Linux /proc).
- nixl_kill.py: The peer's row of the dead-producer repro: a NIXL producer SIGKILLed while its reader READs its
  pool.
- nixl_run.py: NIXL (UCX backend) moving the benchmark's work between two processes: the peer kvwire is measured
  against.
- plot.py: `--plot`: GB/s against request size, one line per method, the limits drawn dashed.
- procs.py: How the benches start their helper processes (a producer, a sender, an engine): forked from one fork
  server that imported torch and kvwire's transfer plane once, instead of a fresh interpreter importing them for
  each (a second or more; more on a busy host).
- prompts.py: The prompts `kvwire demo` and the benches send: edge cases of the block size, short and long.
- report.py: Rows of a transfer benchmark, printed as a table or as JSON.
- sides.py: Two spawned bench processes, a producer (side 0) and a consumer (side 1), stepped over a pipe each.
- transfer.py: `kvwire bench transfer`: every method on the same work, sizes × placements × pool layouts.
- ucx_proto.py: What UCX says it chose: the protocol tables `UCX_PROTO_INFO=y` prints, read back from its log.
- ucxx_run.py: ucxx's own tag send / receive of the benchmark's pieces, with nothing of kvwire's control path around
  it.
- workload.py: The work every method in a transfer benchmark moves: one request's KV, shaped like Llama-3-8B.
- vllm/: `kvwire bench vllm`: real vLLM servers, single-node against disaggregated.
"""
