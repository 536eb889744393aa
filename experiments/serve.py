"""`python -m experiments serve [--checkpoint=checkpoints/tiny] [--host=127.0.0.1] [--port=8000]`

The OpenAI-compatible server (mtpjax/serving/: FastAPI + uvicorn on one continuously running
engine; see mtpjax/serving/app.py for the routes and the request flow) behind absl flags: this
module only turns the flags into a `ServerConfig`, prints progress while the programs compile,
and runs uvicorn.

Requests: `/v1/chat/completions` renders the checkpoint's own chat template
(`chat_template.jinja` or tokenizer_config.json's; `chat_template_kwargs` are its variables,
e.g. {"enable_thinking": false}); `/v1/completions` takes text or token ids. Sampling:
temperature, top_p, top_k (vLLM extension), max_tokens / max_completion_tokens, seed, stop,
n = 1. Any other field gets a 400 naming it (mtpjax/serving/protocol.py).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from absl import flags

from experiments import mesh_flags, weight_flags

if TYPE_CHECKING:              # the library (jax, FastAPI) loads when the server starts
    from mtpjax.serving.app import Server, ServerConfig

FLAGS = flags.FLAGS
mesh_flags.define()
weight_flags.define()
flags.DEFINE_string("checkpoint", "checkpoints/tiny", "checkpoint folder with tokenizer.json")
flags.DEFINE_string("host", "127.0.0.1", "address to listen on")
flags.DEFINE_integer("port", 8000, "port to listen on")
flags.DEFINE_string("served_model_name", None, "the model id clients send (default: the "
                    "checkpoint folder's name)")
flags.DEFINE_integer("num_speculative_tokens", 4, "MTP draft slots K (0 = no speculation)")
flags.DEFINE_boolean("adaptive", True, "choose each step's draft depth 0..K from measured step "
                     "time and acceptance (mtpjax/engine/depth.py); else always K")
flags.DEFINE_integer("max_lanes", 8, "requests decoded together; more wait in the queue")
flags.DEFINE_integer("max_seq_len", 1024, "context limit per request (prompt + output)")
flags.DEFINE_integer("prefill_chunk", 64, "prefill chunk length")
flags.DEFINE_list("prefill_buckets", None, "padded prefill chunk lengths, one compiled program "
                  "each (default 8, 16, ..., prefill_chunk)")
flags.DEFINE_integer("page_size", 16, "KV page size in tokens")
flags.DEFINE_integer("num_pages", 0, "KV pool pages; 0 = every lane at full context")
flags.DEFINE_boolean("prefix_cache", True, "reuse cached prompt prefixes across requests")
flags.DEFINE_integer("prefix_snapshots", 0, "GDN snapshot slots of the prefix cache (one per "
                     "cached boundary; each live conversation keeps one; 151 MB each at 27B); "
                     "0 = min(max(2 * max_lanes, 4), 32)")
flags.DEFINE_integer("snapshot_every_blocks", 4, "the prefix cache's shared-prefix boundaries "
                     "sit at this many pages x 1, 2, 4, 8, ... (besides each prompt's last "
                     "page boundary)")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype")
flags.DEFINE_string("kernels", None, "gdn/attention kernels (default: pallas on GPU, "
                    "reference elsewhere)")
flags.DEFINE_boolean("warmup", True, "compile every program a run can launch before serving "
                     "(Engine.warmup: every depth and lane bucket, every prefill chunk bucket, "
                     "lane moves, snapshots), so no request waits on a compile")
flags.DEFINE_string("log_level", "warning", "uvicorn log level")
flags.DEFINE_integer("max_consecutive_failures", 3, "engine steps failed in a row after which "
                     "the server takes no work (503, /health 503 'unavailable') and probes "
                     "until a step completes")
flags.DEFINE_enum("generation_config", "auto", ["auto", "none"], "sampling defaults of "
                  "requests that leave them out: 'auto' = the checkpoint's "
                  "generation_config.json (temperature, top_p, top_k, penalties), 'none' = "
                  "OpenAI's (temperature 1, top_p 1, no top_k)")
flags.DEFINE_float("probe_interval_s", 1.0, "seconds between probes while the breaker is open")
flags.DEFINE_string("fault_injection", "", "TEST AID, off by default: 'fail_steps:A-B' makes "
                    "engine steps A..B (counted from 1 at the first step after warm-up) fail "
                    "as a device fault would")


def config_of(f=FLAGS) -> ServerConfig:
    """The ServerConfig of parsed flags."""
    from mtpjax.serving.app import ServerConfig
    return ServerConfig(
        checkpoint=f.checkpoint, served_model_name=f.served_model_name,
        num_speculative_tokens=f.num_speculative_tokens, adaptive=f.adaptive,
        max_lanes=f.max_lanes, max_seq_len=f.max_seq_len, prefill_chunk=f.prefill_chunk,
        prefill_buckets=tuple(int(b) for b in f.prefill_buckets) if f.prefill_buckets else None,
        page_size=f.page_size, num_pages=f.num_pages, prefix_cache=f.prefix_cache,
        prefix_snapshots=f.prefix_snapshots, snapshot_every_blocks=f.snapshot_every_blocks,
        dtype=f.dtype, kernels=f.kernels, tp=f.tp, dp=f.dp, weights=f.weights,
        mtp_weights=f.mtp_weights, warmup=f.warmup,
        max_consecutive_failures=f.max_consecutive_failures,
        probe_interval_s=f.probe_interval_s, fault_injection=f.fault_injection,
        generation_config=f.generation_config)


def warmup_with_progress(engine) -> None:
    """Engine.warmup with a line per compiled program on stderr."""
    from experiments.progress import Progress, program_name
    t0 = time.perf_counter()
    log = Progress("serve")
    plan = engine.warmup_plan()
    log(f"compiling the {len(plan)} programs a run can launch (a first run on a CPU takes "
        "a few seconds each; later runs load them from the compilation cache)")
    done = iter(range(1, len(plan) + 1))
    n = engine.warmup(progress=lambda key, sec: log(
        f"compiling {next(done)}/{len(plan)}: {program_name(key)} {sec:.1f} s"))
    print(f"[serve] warmup: {n} programs in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr, flush=True)


def load_server(flag_values=FLAGS) -> Server:
    """Tokenizer, chat template, engine and a started OnlineEngine from the flags."""
    from mtpjax.serving.app import load_server as load
    return load(config_of(flag_values), warmup_with_progress)


def main(argv):
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    import uvicorn
    from mtpjax.serving.app import build_app
    t0 = time.perf_counter()
    server = load_server()
    e = server.online.engine
    print(f"[serve] {FLAGS.checkpoint} as '{server.limits.model}': k={e.k}, lanes="
          f"{e.max_lanes}, context {e.max_seq_len}, {e.num_pages} pages of {e.page_size}, "
          f"kernels={e.kernels}, chat template {server.template.origin}, ready in "
          f"{time.perf_counter() - t0:.1f}s; listening on http://{FLAGS.host}:{FLAGS.port}",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(build_app(server), host=FLAGS.host, port=FLAGS.port,
                    log_level=FLAGS.log_level, timeout_graceful_shutdown=5)
    finally:
        server.online.shutdown()
