"""Draft vocabulary (mtpjax/draft_vocab.py): drafts over N lm_head rows, verification over all.

- the output is the same token for token with and without a draft vocabulary (greedy and
  seeded sampling), while the drafts, hence acceptance, do change;
- with every id in the head, the drafts are exactly the full-vocabulary drafts (acceptance per
  position equal);
- model.draft_tokens == numpy's first argmax over the rows, padding never drafted, and under
  tensor parallelism (tp = 2, an N no tp divides) the engine's tokens and acceptance equal
  tp = 1's; model.draft_candidates (the c best rows, for masked drafts) == numpy's, at
  tp = 1 and 2, with and without a draft head;
- the list file: ranking, save / load, resolution of sizes and shares against a checkpoint,
  clear errors for bad lists.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import draft_vocab as dv
from mtpjax import model
from mtpjax.engine import Engine
from mtpjax.sampling import SamplingParams

from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS
from tiny_models import TP_CFG, TP_ENGINE_KW, TP_PARAMS, TP_PROMPTS, TP_SAMPLING

RNG = np.random.default_rng(3)
PROMPTS = [list(RNG.integers(0, 11, n)) for n in (3, 21, 9, 40, 1)]
# Lane buckets 1 and 3, not the default 1, 2, 3: bucket 2 runs the same code as bucket 1 (a
# step over fewer lane slots than the engine has), one decode program less to compile for each
# of the four engines (the greedy runs check both buckets ran).
# one chunk a step (prefill_rows=1): the requests then end apart and the 1-lane tail runs
LANES = dict(max_lanes=3, max_seq_len=96, prefill_chunk=16, lane_buckets=[1, 3], prefill_rows=1)
KW = dict(num_speculative_tokens=3, **LANES)
SUBSET = [0, 3, 5, 7, 9]          # 5 of 11 ids
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
SAMPLED = [SamplingParams(temperature=1.0, seed=7 + i, max_new_tokens=20) if i % 2 else
           SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=7 + i, max_new_tokens=20)
           for i in range(len(PROMPTS))]
_RUNS: dict = {}
_PROGRAMS: dict = {}


def run(draft, sp, key):
    if (str(draft), key) not in _RUNS:
        eng = Engine(CFG, PARAMS, draft_vocab=draft, **KW)
        _RUNS[(str(draft), key)] = eng.generate(PROMPTS, sp)
        _PROGRAMS[(str(draft), key)] = set(eng.stats()["programs"])
    return _RUNS[(str(draft), key)]


def per_position(outs):
    return [list(o.stats.accepted_per_position) for o in outs]


@pytest.mark.parametrize("key", ["greedy", "sampled"])
def test_outputs_equal_with_and_without_a_draft_vocabulary(key):
    sp = GREEDY if key == "greedy" else SAMPLED
    full, small = run(None, sp, key), run(SUBSET, sp, key)
    for a, b in zip(full, small):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
    # the drafts did change (the test sees the draft head at all), and some still landed
    assert per_position(full) != per_position(small)
    assert sum(o.stats.accepted_tokens for o in small) > 0
    if key == "greedy":     # both lane buckets ran (3 busy lanes, then 1: the greedy tails)
        for draft in (None, SUBSET):
            assert {("decode", 3, 1), ("decode", 3, 3)} <= _PROGRAMS[(str(draft), key)]
    # and both are the stock engine's
    plain = Engine(CFG, PARAMS, num_speculative_tokens=0, **LANES).generate(PROMPTS, sp)
    assert [o.token_ids for o in plain] == [o.token_ids for o in small]


def test_every_id_in_the_head_drafts_exactly_as_the_full_vocabulary():
    full = run(None, GREEDY, "greedy")
    every = run(list(range(CFG.vocab_size))[::-1], GREEDY, "greedy")   # order given: any
    assert per_position(every) == per_position(full)
    assert [o.token_ids for o in every] == [o.token_ids for o in full]


def test_draft_tokens_is_the_first_argmax_over_the_rows():
    ids = np.array([1, 4, 6, 9], np.int32)
    head = dv.build_head(PARAMS, ids)
    h = jax.random.normal(jax.random.key(0), (6, CFG.hidden_size))
    got = np.asarray(model.draft_tokens(CFG, dataclasses.replace(PARAMS, draft=head), h))
    logits = np.asarray(h) @ np.asarray(PARAMS.lm_head)[ids].T
    np.testing.assert_array_equal(got, ids[np.argmax(logits, axis=-1)])
    # padding rows (id -1, zero rows) never win, even where every real row scores below zero
    pad = dv.build_head(PARAMS, ids, tp=3)
    assert pad.weight.shape[0] == 6 and list(np.asarray(pad.ids)[4:]) == [-1, -1]
    neg = dataclasses.replace(pad, weight=pad.weight.at[:4].set(-1.0))
    got = np.asarray(model.draft_tokens(CFG, dataclasses.replace(PARAMS, draft=neg),
                                        jnp.ones((3, CFG.hidden_size))))
    assert got.tolist() == [1, 1, 1]      # all real rows tie at -H: the first id


def _top_rows(logits, ids, c):
    """numpy: the ids of the c best rows, best first, ties to the lower id; -1 past them."""
    order = np.argsort(-logits, axis=-1, kind="stable")[..., :c]
    out = np.asarray(ids)[order]
    return np.pad(out, [(0, 0)] * (out.ndim - 1) + [(0, c - out.shape[-1])],
                  constant_values=-1)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("head", [None, [0, 2, 3, 5, 8, 11, 12]])
def test_draft_candidates_are_the_best_rows_under_tensor_parallelism(tp, head):
    """model.draft_candidates (masked drafts of constrained lanes): the ids of the c best
    draft rows, best first, the first being the draft; -1 past the rows there are (7 head
    rows, padded to 8 for tp = 2) and everywhere when not wanted. tp = 2: the shards' top c
    gathered and merged (TP_CFG's vocabulary of 13: a padded block)."""
    from jax.sharding import PartitionSpec as P
    from mtpjax import tensor_parallel as tpl
    c = 8
    h = jax.random.normal(jax.random.key(5), (3, TP_CFG.hidden_size))
    w = np.asarray(TP_PARAMS.lm_head)
    ids = np.arange(TP_CFG.vocab_size) if head is None else np.asarray(head)
    want = _top_rows(np.asarray(h) @ w[ids].T, ids, c)
    mesh = tpl.make_meshes(tp, 1)[0] if tp > 1 else None
    params = tpl.place_params(TP_CFG, TP_PARAMS, mesh)
    if head is not None:
        params = dataclasses.replace(params, draft=dv.build_head(params, ids, tp, mesh))
    for on in (True, False):
        if mesh is None:
            tok, cands = model.draft_candidates(TP_CFG, params, h, c, jnp.bool_(on))
        else:
            specs = tpl.param_specs(TP_CFG, tp)
            if head is not None:
                specs = dataclasses.replace(specs, draft=dv.head_spec(tp))
            f = tpl.spmd(lambda p, x, o: model.draft_candidates(tpl.shard_config(TP_CFG, tp),
                                                                 p, x, c, o),
                         mesh, (specs, P(), P()), (P(), P()))
            tok, cands = f(params, h, jnp.bool_(on))
        np.testing.assert_array_equal(np.asarray(tok), want[:, 0])
        np.testing.assert_array_equal(np.asarray(cands), want if on else -np.ones_like(want))
    if head is not None:
        assert (want[:, -1] == -1).all()          # 7 rows: the 8th candidate is none


def test_tensor_parallel_draft_head_equals_one_device():
    ids = [0, 2, 3, 5, 8, 11, 12]          # 7 rows: padded to 8 for tp = 2
    kw = dict(TP_ENGINE_KW, max_lanes=1)
    one = Engine(TP_CFG, TP_PARAMS, num_speculative_tokens=2, draft_vocab=ids,
                 **kw).generate(TP_PROMPTS, TP_SAMPLING)
    two = Engine(TP_CFG, TP_PARAMS, num_speculative_tokens=2, draft_vocab=ids, tp=2,
                 **kw).generate(TP_PROMPTS, TP_SAMPLING)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert per_position(two) == per_position(one)
    full = Engine(TP_CFG, TP_PARAMS, num_speculative_tokens=2, **kw).generate(TP_PROMPTS,
                                                                                TP_SAMPLING)
    assert [o.token_ids for o in full] == [o.token_ids for o in one]


def test_ranking_save_load_and_resolution(tmp_path):
    counts = dv.count_tokens([[3, 3, 3, 1, 1, 7], [1, 3]], 10, always=[9])
    vocab = dv.from_counts(counts, "test")
    assert vocab.ranking[:4].tolist() == [9, 3, 1, 7]       # always first, then by count
    assert vocab.ranking[4:].tolist() == [0, 2, 4, 5, 6, 8]  # never seen: id order
    assert vocab.top(3).tolist() == [1, 3, 9]               # ascending
    assert vocab.coverage(2) == pytest.approx(9 / 13)
    vocab.save(str(tmp_path / dv.FILE))
    back = dv.DraftVocab.load(str(tmp_path))
    assert back.ranking.tolist() == vocab.ranking.tolist() and back.source == "test"
    assert dv.resolve(3, 10, str(tmp_path)).tolist() == [1, 3, 9]
    assert dv.resolve(0.5, 10, str(tmp_path)).tolist() == sorted([9, 3, 1, 7, 0])
    assert dv.resolve(str(tmp_path / dv.FILE), 10).tolist() == [1, 3, 7, 9]
    assert dv.resolve(None, 10) is None and dv.resolve(0, 10) is None


@pytest.mark.parametrize("spec, match", [
    ([1, 1, 2], "distinct"), ([0, 11], r"\[0, 11\)"), ([], "non-empty"),
    (3, "beside a checkpoint"), (1.5, "share"), (True, "size, a share"),
])
def test_bad_draft_vocabularies_are_refused(spec, match, tmp_path):
    dv.from_counts(np.ones(11, np.int64)).save(str(tmp_path / dv.FILE))
    ckpt = str(tmp_path) if isinstance(spec, float) else None
    with pytest.raises(ValueError, match=match):
        Engine(CFG, PARAMS, num_speculative_tokens=1, max_lanes=1, max_seq_len=32,
               draft_vocab=dv.resolve(spec, 11, ckpt) if ckpt else spec)


def test_list_for_another_vocabulary_and_stock_engine_are_refused(tmp_path):
    dv.from_counts(np.ones(50, np.int64)).save(str(tmp_path / dv.FILE))
    with pytest.raises(ValueError, match="50 tokens, the model has 11"):
        dv.resolve(4, 11, str(tmp_path))
    with pytest.raises(ValueError, match="num_speculative_tokens > 0"):
        Engine(CFG, PARAMS, num_speculative_tokens=0, max_lanes=1, max_seq_len=32,
               draft_vocab=[1, 2])
    with open(tmp_path / "bad.json", "w") as f:
        json.dump({"format": "other"}, f)
    with pytest.raises(ValueError, match="not a draft vocabulary"):
        dv.DraftVocab.load(str(tmp_path / "bad.json"))
    with pytest.raises(FileNotFoundError, match="experiments draft_vocab"):
        dv.DraftVocab.load(str(tmp_path / "missing"))


TINY = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny")


def test_the_tiny_checkpoint_ships_a_list_that_from_checkpoint_resolves():
    vocab = dv.DraftVocab.load(TINY, 4096)
    cfg = mtpjax.Config.from_pretrained(TINY)
    assert set(vocab.ranking[:len(cfg.eos_token_ids)].tolist()) == set(cfg.eos_token_ids)
    assert vocab.coverage(410) > 0.5          # a ranking by counts, not ids in order
    eng = Engine.from_checkpoint(TINY, num_speculative_tokens=1, max_lanes=1, max_seq_len=32,
                                 draft_vocab=0.1)
    assert eng.draft_ids.tolist() == vocab.top(410).tolist()
    assert eng.params.draft.weight.shape == (410, cfg.hidden_size)
    np.testing.assert_array_equal(np.asarray(eng.params.draft.weight),
                                  np.asarray(eng.params.embed)[vocab.top(410)])   # tied head


def test_draft_vocab_command_ranks_a_corpus_by_counts(tmp_path):
    """`python -m experiments draft_vocab` on a text file: the ids come out ranked by their
    count in the file as the checkpoint's tokenizer encodes it, end-of-turn ids first."""
    import subprocess
    import sys
    from tokenizers import Tokenizer
    text = "def f(x):\n    return x + 1\n" * 50 + "class A:\n    pass\n" * 7
    (tmp_path / "c.txt").write_text(text)
    out = tmp_path / "dv.json"
    root = os.path.join(os.path.dirname(__file__), "..")
    r = subprocess.run([sys.executable, "-m", "experiments", "draft_vocab", f"--checkpoint={TINY}",
                        f"--corpus={tmp_path / 'c.txt'}", "--greedy_prompts=0",
                        f"--out={out}", "--progress=false", "--nocompilation_cache"],
                       cwd=root, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-2000:]
    ids = Tokenizer.from_file(os.path.join(TINY, "tokenizer.json")).encode(text).ids
    eot = Tokenizer.from_file(os.path.join(TINY, "tokenizer.json")).token_to_id("<|endoftext|>")
    counts = np.bincount(ids + [eot], minlength=4096)
    vocab = dv.DraftVocab.load(str(out), 4096)
    eos = mtpjax.Config.from_pretrained(TINY).eos_token_ids
    assert set(vocab.ranking[:len(eos)].tolist()) == set(eos)
    rest = [t for t in vocab.ranking[len(eos):] if counts[t] > 0 and t not in eos]
    assert [counts[t] for t in rest] == sorted((counts[t] for t in rest), reverse=True)
    assert len(rest) == int((counts > 0).sum()) - len(set(eos) & set(np.nonzero(counts)[0]))
    assert "top" in r.stdout and "cover" in r.stdout
