"""`kvwire bench vllm`: real vLLM servers, single-node against disaggregated.

File map: run.py, the bench and its table; setups.py, the setups it measures (each started on its own
and stopped whole); mix.py, the prompt mix and one streamed request measured at the client;
multiturn.py, `--workload multiturn` (conversations through the scheduler); host.py, how busy the host
was with other work while a setup was measured.
"""
