"""Native Llama-family models over paged KV, with CUDA graphs."""
