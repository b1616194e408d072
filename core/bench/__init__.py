"""speculum.bench: ``speculum bench serve``, a load generator for OpenAI-compatible servers.

It sends MT-bench (or a JSONL of prompts) at a Poisson request rate or a fixed
concurrency, streams every answer, and reports TTFT, TPOT, ITL, end-to-end latency,
throughput and the server's speculation acceptance (from /metrics). ``--compare``
starts a baseline and a speculative ``speculum serve`` itself and plots both.
"""
