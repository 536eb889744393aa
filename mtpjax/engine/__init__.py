"""The serving engine: lanes, a paged KV pool, and the host loop around the step programs.

Layout (vLLM v1's names):
  engine.py        `Engine`, the public façade: sessions, submit/step/stop, stats, warm-up
  core.py          `EngineCore` (no JAX): validation, pages, prefix-cache and depth policy,
                   the host state of grammars, penalties and stop strings, output processing
  scheduler.py     `Scheduler` (no JAX): queue, lanes, admission, preemption, the plan
  batch.py         `Batch`, the per-step record the core hands the runner (host arrays), its
                   `StepResult`, and the `StepShapes` every record is padded to
  runner.py        `ModelRunner`: the only owner of device state and compiled programs;
                   placement, warm-up, the program plan, timing
  kv_pool.py, prefix_cache.py, snapshots.py, depth.py: pages, cached prefixes, GDN
                   snapshot programs, the adaptive depth policy

The engine core (host side) and its model runner (device side) are joined by one ordered
record per iteration: the scheduler's plan (`scheduler.StepBatch`: which lane holds which
request, its position, real drafts and whether its last prompt token joins now, the step's
depth, the prefill chunk), which the core turns into the runner's `batch.Batch`.
Everything after the step (tokens to requests, acceptance to the depth policy, snapshots to
the prefix cache) reads the plan, in its row order. Words: K (`num_draft_slots`, the
public `num_speculative_tokens`) is how many drafts a lane holds; a step's `depth` (0..K)
is how many it verifies. The same code with num_speculative_tokens = 0 is the stock engine
the judge compares against.

Errors. Invalid requests end with finish_reason "error" and never touch the device. One
request's host state that raises (its grammar walk, its penalties' history, its output
processing: stops, grammar, on_token, e.g. a text layer's stop strings; its input to the
depth policy) ends that request only, "error" with the message; the step runs without it
and every other lane goes on, token for token (tests/test_host_faults.py). A failure of
the step itself (a program, or the policy on every lane) raises from `step()`: the device
state may be lost (donated buffers), so callers `stop()` and `reset_device_state()` (the
online engine does, mtpjax/serving/online.py).

Host loop (one iteration, ONE program that reads the weights once):
  1. `Scheduler.schedule()`: cancellations, admission by page budget, page reservation for this
     iteration's writes (preemption by recompute when the pool is short), speculation depth,
     the StepBatch record
  2. the decode step over the decoding lanes at the depth 0..K the policy chose (fixed:
     SpeculationPolicy; adaptive: depth.AdaptiveDepth, which learns from the step time and
     acceptance the engine reports), carrying at most one lane's prefill chunk (up to
     prefill_chunk tokens: the iteration's prefill token budget) in the same forward
     (steps.decode_step(chunk=...), key ("mixed", depth, lane_slots, T): T its ride bucket); a
     lane whose chunk reaches its last prompt token joins the step with that token and gets
     its first token from it. With no lane decoding, the chunk runs alone (`prefill_chunk`).
  3. a snapshot save when the chunk ended at a prefix-cache boundary (then the entry is
     published)
  4. read back the emitted tokens; the scheduler applies stop conditions, streams them to
     on_token and frees finished lanes' pages

Structured output (SamplingParams.grammar, mtpjax/grammar.py): a constrained request keeps an
llguidance matcher on the host (scheduler.Request.constraint, advanced by its emitted tokens);
before each decode step the engine reads back the drafts the step verifies and hands the step
one packed token mask per verify row (`EngineCore._masks`: the grammar state after the
emitted tokens and the drafts before that row), so verification samples from the masked
target distribution and the output is constrained plain decoding's, token for token. The masks are an input of every
decode program (one cached all-allowed array when no lane is constrained): no extra program.
The drafts are masked too (`mask_drafts`): a step with a constrained lane also records each
draft's best draft-head candidates (LaneState.candidates), and before the next step the host
replaces each draft the lane's grammar forbids by the first allowed candidate (the masked
argmax of the draft logits; grammar.Constraint.masked_drafts) and writes the corrected drafts
into the lane state, so the step verifies drafts the grammar allows instead of drafts
verification must reject.

Log probabilities and logit_bias (SamplingParams.logprobs / .logit_bias): every decode step
takes a `steps.Extras` (each lane's bias, padded sparse ids + values, and whether it wants log
probabilities; one cached all-off set when no lane asks: no extra program) and returns the log
probabilities of every verify row (the raw target distribution's: log_softmax of the model's
logits; the chosen token's and the top steps.TOP_LOGPROBS). They are read back only when a
lane asked, and each emitted token gets the record of the row it came from, which is the
plain engine's row for that position: speculation changes neither (tests/test_logprobs.py).
The bias is added to the target logits before verification samples from them, so the biased
output is exact too.

Penalties (SamplingParams.presence_penalty / frequency_penalty / repetition_penalty) ride in
the same `steps.Extras`: each penalised lane's tokens so far (prompt + output: the host knows
them, scheduler.Request.prompt / .out, also after a preemption, which keeps both, and for
each of n sibling requests, which are requests of their own) as one fixed-shape history row
of the lane's token capacity, and the three values. The step counts the history on device and
adds the drafts before each verify row (steps._penalized), so every row sees the counts a
plain sampler at its position sees: the penalised output is exact under speculation, greedy
and seeded. The host keeps the history rows between steps (`_history`) and writes only each
lane's new tokens; the row goes to the device only in a step with a penalised lane.

Device state: `model.Cache` with a `PagedKV` pool per full-attention layer and for the MTP layer
([NKV, num_pages, page_size, HD] each) plus per-lane GDN slots per GDN layer, and
`steps.LaneState`.
The page table (kv_pool.PageAllocator.table) is sent with every program call.

Compiled programs: one prefill program per chunk bucket (default 8, 16, ... prefill_chunk), one
decode program per (draft depth used (0..K), lane bucket: default 1, 2, 4, ... max_lanes, or
`lane_buckets`) and one more per depth up to mixed_max_depth and ride bucket with a chunk riding (over every
lane slot, whatever the busy lanes: the padding rows are few beside the chunk's tokens, and
the programs stay few). A decode step runs only the lane slots up to the highest busy lane, rounded up to a
bucket, so idle lanes cost nothing; `stats()["compiled_programs"]`. `warmup()` compiles every
program a run can reach up front. Programs are keyed by shapes, so engines that agree on
lane_slots, pool_pages, max_seq_len, page_size and K share them (the judge builds its engines
that way: one program set for every workload).

The H200 clock (`clock=`, a cost_model.VirtualClock): the engine runs here, on whatever device
JAX has, with real tokens and real acceptance, while time is that of Qwen3.5-27B on an H200.
Every program `step()` launches (lane moves, snapshot restores, prefill chunks, snapshot
saves, decode steps; not `warmup()`) runs to completion and then advances the clock by the
cost model's price of that program at its real shapes: ("decode", depth, lane bucket) with
the tokens each busy lane has cached, ("prefill", chunk bucket) with the chunk's start and
whether it is the prompt's last. This device's own compute time is not counted. Host time is
measured: the wall time inside `step()` outside the launched programs (scheduling, page
bookkeeping, building inputs, reading tokens back into lists, the depth policy, this device's
dispatch and sync overhead outside a program's bracket), minus the time spent in the caller's
on_token callbacks (the caller's work, e.g. a benchmark's own bookkeeping); it goes to
`clock.add_host` and `timing["host_s"]`. With a clock, `timing["step_s"]` and
`timing["prefill_s"]` hold modelled seconds, the depth policy learns from modelled step
seconds, `timing["ttft_s"]` / `timing["first_tokens"]` add up each request's time to first
token on the clock (from `submit` to the end of its last prefill chunk), and `stats()["clock"]`
is `clock.report()`.

Engine arguments
----------------
kernels: "reference" (plain jnp), "pallas" (Triton kernels) or "interpret" (the Pallas
  interpreter, CPU tests); default: pallas on GPU, reference elsewhere.
page_size, num_pages: the KV pool; num_pages defaults to every lane at full context (no
  preemption). A smaller pool admits by page budget and preempts by recompute.
speculation_policy: each step's draft depth 0..K: None or "fixed" = K whenever the pages
  allow (scheduler.SpeculationPolicy), "adaptive" = depth.AdaptiveDepth() (the depth that
  maximizes expected tokens per second from measured step cost and acceptance), or any
  scheduler.Policy.
prefill_buckets: padded chunk lengths, one prefill program each (default 8, 16, ...,
  prefill_chunk); the largest must be prefill_chunk.
prefix_cache: reuse cached prompt prefixes (KV pages + GDN snapshots, see
  mtpjax/prefix_cache.py), across requests and generate calls; output is the same with
  it on or off. Cached KV pages are pool pages that requests take back on demand (LRU).
  prefix_snapshots: GDN snapshot slots, a fixed device allocation beside the pool
  (default min(max(2 * max_lanes, 4), 32); stats()["prefix_cache"]["slot_bytes"]; 151 MB
  each at 27B, so size num_pages and prefix_snapshots together within the memory budget).
  snapshot_every_blocks: besides each prompt's last page boundary (its head, what a
  conversation's next turn and n > 1 siblings reuse), a prompt's prefill snapshots the
  chunk ends at this many pages x 1, 2, 4, ... (chunks end at multiples of prefill_chunk,
  the same positions for every request): a bounded number of entries per prompt, and any
  shared prefix reused to at least half its length. Eviction is LRU with live
  conversation heads last (mtpjax/engine/prefix_cache.py).
mixed_max_depth: the deepest step that carries a prefill chunk (default K; the policy's
  depth is capped to it in those iterations): each depth is one program per ride bucket.
ride_buckets: the padded lengths of a chunk riding in a decode step, one program per depth
  each (default: the smallest chunk bucket >= page_size, and prefill_chunk; the largest
  must be prefill_chunk). A prompt's last chunk is often short (with the prefix cache it
  is at most the tokens after the last page boundary): padded to prefill_chunk it would
  cost a compute-bound pass (a 512-token chunk at 27B: ~35 ms instead of ~2 ms).
prefill_rows: packed prefill: up to this many lanes' prefill chunks ride in one step
  (default min(4, max_lanes); 1: one chunk a step), oldest first. Several chunks run as
  prefill_rows rows of the longest one's ride bucket (of prefill_chunk when no lane
  decodes): one more program per ride bucket and mixed depth, and one prefill program. When several conversations start a turn together,
  their prompts are prefilled side by side instead of one per step (time to first token),
  at the cost of one heavier step for the lanes decoding beside them.
depth0_fills_mtp_kv: a depth-0 step of a K > 0 engine writes the MTP KV of the pair it
  commits (True) or is the stock step (False, default: later drafts attend the stale
  entries, a measured acceptance cost of about nothing; see steps.py).

Shapes and programs. Every compiled program is keyed by the shapes of what it takes, so
these set how many programs a run compiles (each costs seconds to compile and, on XLA:CPU,
some 600 of the process's 65,530 memory mappings):
max_lanes: requests decoded together (the rest wait in the queue).
lane_slots: lane slots in the device state (GDN state, lane state, page table rows;
  default max_lanes, at least max_lanes). Engines with different max_lanes but the same
  lane_slots (and pool, context, K) share every compiled program.
lane_buckets: the lane counts a decode step is compiled for (default 1, 2, 4, ...
  max_lanes): a step over n busy lanes runs the smallest bucket >= n, so each extra
  bucket is one more program per draft depth. Idle lanes inside a bucket are padding
  (nearly free when decode is memory-bound, compute on a CPU).
pool_pages: the device pool's pages (at least num_pages); the allocator hands out
  num_pages of them, so engines with different page budgets can share a pool shape, hence
  their programs. Default: num_pages; with lane_slots given, the larger of num_pages and
  every lane slot at full context (lane_slots x pages_per_lane), the pool that engines of
  one lane_slots share whatever their max_lanes and num_pages (the judge's engines).

draft_vocab: None (default: drafts take the argmax over the whole vocabulary) or the
  draft vocabulary (mtpjax/draft_vocab.py: token ids, or a DraftVocab / its path; a size
  N is resolved by from_checkpoint against the list beside the checkpoint): the MTP
  drafts over those lm_head rows only, gathered here into params.draft. Verification is
  unchanged, so outputs are too; a draft is cheaper (N x H read, not V x H) and accepted
  a little less often.

grammar_tokenizer: what structured output (SamplingParams.grammar) tokenizes with: an
  llguidance LLTokenizer, a tokenizer.json or checkpoint folder path, or a
  text.Tokenizer; built lazily at the first constrained request (from_checkpoint passes
  the checkpoint's tokenizer.json). None: a request with a grammar ends "error". Each
  step's verification then samples from the grammar-masked target distribution, the
  output of constrained plain decoding token for token (mtpjax/grammar.py); the masks are
  an input of every decode program (all-allowed without a constrained lane), so they add
  no program.
mask_drafts: correct a constrained lane's drafts by its grammar before each step (True,
  default; see `EngineCore._masks`), or verify the MTP's drafts as they are (False: for comparison;
  the output is the same either way, only acceptance differs). An attribute: it can be
  changed between steps, with the same programs.

clock: None (default: wall time, as measured) or a cost_model.VirtualClock whose model has
  this engine's K and page size: time is then the modelled H200's (module docstring).
  timing["step_s"] and timing["prefill_s"] then hold modelled seconds, timing["host_work_s"]
  the measured host seconds added to the clock, timing["host_s"] the part of them the
  modelled device waited for (the clock keeps the host's and the device's timelines).

overlap: True (default): plan and launch step N+1 while the device runs step N, then read
  step N's tokens (a lane whose next step needs its tokens on the host, for a grammar, the
  penalties' history or a token limit within reach, waits a step); False: the serial loop
  (plan, launch, wait, commit). The outputs are the same (tests/test_overlap.py). Without a
  clock, timing["host_s"] is the device's idle time between launches (at most), and
  timing["host_work_s"] the host's own time.

simulate_acceptance: None, or a profile name / path / simulated_acceptance.Profile or
  Simulator: each verify step accepts as many drafts as a seeded draw from the profile (the
  core fills Batch.forced_accept, steps.Extras.forced_accept), for timing on the clock only:
  the tokens are not the model's.
"""

import importlib

from mtpjax.engine.kv_pool import OutOfPagesError
from mtpjax.engine.scheduler import (FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP,
                                     RequestOutput, RequestStats, SpeculationPolicy,
                                     TokenLogprob)
from mtpjax.engine.depth import AdaptiveDepth

__all__ = ["Engine", "RequestOutput", "RequestStats", "TokenLogprob", "SpeculationPolicy",
           "AdaptiveDepth", "OutOfPagesError", "FINISH_STOP", "FINISH_LENGTH", "FINISH_ERROR",
           "FINISH_CANCELLED", "default_kernels"]

# These import JAX: loaded on first use, so that `mtpjax.engine.core` and `.scheduler` do not.
_LAZY = {"Engine": "mtpjax.engine.engine", "default_kernels": "mtpjax.engine.runner"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mtpjax.engine' has no attribute {name!r}")
