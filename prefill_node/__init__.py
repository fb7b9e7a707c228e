"""The prefill node: computes prompts and hands their KV to the transfer plane."""
