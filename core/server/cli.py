"""``speculum serve``: the OpenAI-compatible server from the command line.

Only argparse is imported here; FastAPI, uvicorn and the engine load when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)",
                       description="Serve a model over an OpenAI-compatible HTTP API. See docs/serving.md.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="transformers directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model", default=None, help="same as MODEL")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculation settings, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $SPECULUM_API_KEY if set)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use (default: MODEL as given)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests decoded together (default 32)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (prompt + output) (default: the model's context length)")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=0, help="engine seed (requests without a seed draw from it)")
    p.add_argument("--per-request-spec-decode-metrics", choices=("none", "summary", "detailed"), default="none",
                   help="add metrics.speculative_decoding to each response (needs --speculative-config)")
    p.add_argument("--log-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between stats log lines (0: off)")
    p.add_argument("--disable-access-log", action="store_true", help="do not log every HTTP request")
    from speculum.cli import add_backend_args
    add_backend_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args) -> int:
    from speculum.config import SpeculativeConfig
    from speculum.errors import ConfigError
    from speculum.model_source import DEFAULT_MODEL

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ConfigError(f"two models given ({args.model_tag!r} and --model {args.model!r}); give one")
    model = args.model_tag or args.model
    spec = SpeculativeConfig.from_cli(args.speculative_config)
    level = args.per_request_spec_decode_metrics
    if level != "none" and spec is None:  # fail before loading anything
        raise ConfigError(f"--per-request-spec-decode-metrics {level} reports speculation, but speculation is "
                          "off; add --speculative-config (e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": "
                          "4}') or use none")
    logging.getLogger("speculum").setLevel(logging.INFO)
    api_key = args.api_key or os.environ.get("SPECULUM_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logging.getLogger("speculum.server").warning(
            "binding %s without --api-key: anyone who reaches this address can use the server", args.host)

    from speculum.engine import LLM
    from speculum.server.app import create_app
    from speculum.server.runner import serve_forever

    from speculum.cli import engine_options
    llm = LLM(model, spec, dtype=args.dtype, device=args.device, seed=args.seed,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, **engine_options(args))
    names = args.served_model_name or [model or DEFAULT_MODEL]
    app = create_app(llm, model_names=names, api_key=api_key, spec_metrics_level=level,
                     log_interval_s=args.log_interval)
    print(f"speculum: serving {names[0]} on http://{args.host}:{args.port} "
          f"(speculation: {spec.method or spec.model if spec else 'off'})", file=sys.stderr, flush=True)
    serve_forever(app, args.host, args.port, access_log=not args.disable_access_log)
    return 0
