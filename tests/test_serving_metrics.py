"""/metrics (mtpjax/serving/metrics.py): prometheus_client generates it from a stats snapshot
with the right types (running totals are counters, levels and ratios gauges, iteration time a
histogram), values as the snapshot has them, in both exposition formats, from a registry per
server that never touches the process-wide one."""

import prometheus_client
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text

from mtpjax.serving import metrics
from mtpjax.serving.online import ITERATION_BUCKETS, OnlineStats

ENGINE = {"free_pages": 5, "total_pages": 9, "steps": 12, "step_s": 0.5, "prefill_s": 0.25,
          "prefill_chunks": 3, "preemptions": 1, "depth_steps": [2, 10],
          "prefix_cache": {"lookups": 6, "hits": 4, "tokens_reused": 64, "inserted": 3,
                           "evicted": 1, "snapshots": 2, "snapshot_slots": 4,
                           "snapshot_slots_free": 1, "snapshots_pending": 1, "cached_pages": 3,
                           "hit_rate": 4 / 6, "reused_fraction": 0.5, "slot_bytes": 7}}


def stats(**kw) -> OnlineStats:
    buckets = [0] * len(ITERATION_BUCKETS)
    buckets[0], buckets[3] = 2, 1
    base = dict(running=2, waiting=1, finished={"length": 3, "cancelled": 1}, prompt_tokens=40,
                generation_tokens=30, verify_steps=10, drafted_tokens=12, accepted_tokens=6,
                accepted_per_position=[5, 1], tried_per_position=[8, 4], iterations=4,
                iteration_seconds=0.3, iteration_buckets=buckets, engine_errors=0,
                engine=ENGINE)
    return OnlineStats(**{**base, **kw})


COUNTERS = ["mtpjax_requests_finished", "mtpjax_prompt_tokens", "mtpjax_generation_tokens",
            "mtpjax_verify_steps", "mtpjax_draft_tokens", "mtpjax_accepted_tokens",
            "mtpjax_draft_accepted", "mtpjax_draft_tried", "mtpjax_engine_errors",
            "mtpjax_device_rebuilds", "mtpjax_breaker_opens", "mtpjax_breaker_probes",
            "mtpjax_decode_step_seconds", "mtpjax_decode_steps", "mtpjax_decode_steps_by_depth",
            "mtpjax_prefill_seconds", "mtpjax_prefill_chunks", "mtpjax_preemptions",
            "mtpjax_prefix_cache_lookups", "mtpjax_prefix_cache_hits",
            "mtpjax_prefix_cache_tokens_reused", "mtpjax_prefix_cache_inserted",
            "mtpjax_prefix_cache_evicted"]
GAUGES = ["mtpjax_requests_running", "mtpjax_requests_waiting", "mtpjax_tokens_per_verify_step",
          "mtpjax_draft_acceptance_rate", "mtpjax_kv_free_pages", "mtpjax_kv_total_pages",
          "mtpjax_prefix_cache_snapshots", "mtpjax_prefix_cache_snapshot_slots",
          "mtpjax_prefix_cache_snapshot_slots_free", "mtpjax_prefix_cache_snapshots_pending",
          "mtpjax_prefix_cache_cached_pages", "mtpjax_prefix_cache_hit_rate",
          "mtpjax_prefix_cache_reused_fraction", "mtpjax_consecutive_step_failures",
          "mtpjax_breaker_open"]


def scrape(st: OnlineStats, accept: str | None = None):
    body, content_type = metrics.render(metrics.make_registry(lambda: st, "tiny"), accept)
    return body.decode(), content_type


def by_name(text, parse=parse_text):
    return {f.name: f for f in parse(text)}


def value(family, name, **labels):
    hits = [s.value for s in family.samples
            if s.name == name and labels.items() <= s.labels.items()]
    assert len(hits) == 1, (name, labels, family.samples)
    return hits[0]


@pytest.mark.parametrize("accept, parse", [(None, parse_text),
                                           ("application/openmetrics-text", parse_om)])
def test_types(accept, parse):
    text, content_type = scrape(stats(), accept)
    assert content_type.startswith("application/openmetrics-text" if accept else "text/plain")
    fams = by_name(text, parse)
    assert {n: fams[n].type for n in COUNTERS} == dict.fromkeys(COUNTERS, "counter")
    assert {n: fams[n].type for n in GAUGES} == dict.fromkeys(GAUGES, "gauge")
    assert fams["mtpjax_iteration_seconds"].type == "histogram"
    assert set(fams) == set(COUNTERS) | set(GAUGES) | {"mtpjax_iteration_seconds"}
    assert all(s.labels["model"] == "tiny" for f in fams.values() for s in f.samples)


def test_values_follow_the_snapshot():
    fams = by_name(scrape(stats())[0])
    f = fams["mtpjax_requests_finished"]
    assert value(f, "mtpjax_requests_finished_total", finish_reason="length") == 3
    assert value(f, "mtpjax_requests_finished_total", finish_reason="stop") == 0   # pre-seeded
    assert value(fams["mtpjax_prompt_tokens"], "mtpjax_prompt_tokens_total") == 40
    assert value(fams["mtpjax_draft_tried"], "mtpjax_draft_tried_total", position="2") == 4
    assert value(fams["mtpjax_draft_acceptance_rate"], "mtpjax_draft_acceptance_rate",
                 position="1") == 5 / 8
    assert value(fams["mtpjax_tokens_per_verify_step"], "mtpjax_tokens_per_verify_step") == 1.6
    assert value(fams["mtpjax_decode_steps_by_depth"], "mtpjax_decode_steps_by_depth_total",
                 depth="1") == 10
    assert value(fams["mtpjax_prefix_cache_evicted"], "mtpjax_prefix_cache_evicted_total") == 1
    assert value(fams["mtpjax_kv_free_pages"], "mtpjax_kv_free_pages") == 5
    assert value(fams["mtpjax_prefix_cache_snapshot_slots_free"],
                 "mtpjax_prefix_cache_snapshot_slots_free") == 1
    assert value(fams["mtpjax_prefix_cache_snapshots_pending"],
                 "mtpjax_prefix_cache_snapshots_pending") == 1
    h = fams["mtpjax_iteration_seconds"]
    cum = [value(h, "mtpjax_iteration_seconds_bucket", le=str(float(le)))
           for le in ITERATION_BUCKETS] + [value(h, "mtpjax_iteration_seconds_bucket",
                                                 le="+Inf")]
    assert cum == [2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 4]
    assert value(h, "mtpjax_iteration_seconds_count") == 4
    assert value(h, "mtpjax_iteration_seconds_sum") == 0.3


def test_an_engine_without_prefix_cache_has_no_prefix_metrics():
    fams = by_name(scrape(stats(engine={**ENGINE, "prefix_cache": None}))[0])
    assert not [n for n in fams if n.startswith("mtpjax_prefix_cache")]


def test_each_server_has_its_own_registry():
    """Two servers in one process: no clash, each scrape reads its own stats, and the
    process-wide registry gains nothing."""
    before = {m.name for m in prometheus_client.REGISTRY.collect()}
    a = metrics.make_registry(lambda: stats(prompt_tokens=1), "a")
    b = metrics.make_registry(lambda: stats(prompt_tokens=2), "b")
    for reg, model, n in ((a, "a", 1), (b, "b", 2)):
        fam = by_name(metrics.render(reg)[0].decode())["mtpjax_prompt_tokens"]
        assert value(fam, "mtpjax_prompt_tokens_total", model=model) == n
    assert {m.name for m in prometheus_client.REGISTRY.collect()} == before


def test_each_scrape_reads_a_fresh_snapshot():
    snaps = iter([stats(generation_tokens=3), stats(generation_tokens=8)])
    reg = metrics.make_registry(lambda: next(snaps), "tiny")     # registering reads nothing
    got = [value(by_name(metrics.render(reg)[0].decode())["mtpjax_generation_tokens"],
                 "mtpjax_generation_tokens_total") for _ in range(2)]
    assert got == [3, 8]
