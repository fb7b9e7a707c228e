"""The prompts `kvwire demo` and the benches send: edge cases of the block size, short and long."""

PROMPTS = [
    "a",  # one token
    "Disaggregated prefill moves KV!",  # fits in the first block
    "0123456789abcdef" * 2,  # exactly 2 x block_size bytes
    "0123456789abcdef" * 2 + "!",  # 2 x block_size + 1
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Decode nodes skip the prompt when its KV arrives.",
    "kvwire " * 160,  # over 1,000 tokens
    "Hello, world",
]
