"""/health (liveness) and /ready (readiness): one JSON body, two answers.

/health is 200 whenever the coordinator answers, whatever its status; /ready is 200 only while
it serves and every rank reports serving, else 503. Neither needs the API key (auth.py).
"""

from __future__ import annotations

from dataclasses import asdict


def probe_body(state) -> dict:
    engine, facts, startup = state.engine, state.engine.facts, state.engine.startup
    ranks = engine.rank_states()
    # Every rank walks the same block pool identically; the total is the leader's report.
    num_total = facts.num_kv_blocks if facts else 0
    return {
        "status": state.status, "model": state.model.name,
        "ready": is_ready(state, ranks),
        "registry_digest": facts.registry_digest if facts else None,
        "ranks": [asdict(rank) for rank in ranks],
        "kv_blocks": {"used": num_total - engine.load.num_free_blocks,
                      "free": engine.load.num_free_blocks, "total": num_total},
        "max_num_seqs": facts.max_num_seqs if facts else None,
        "max_queued_requests": state.admission.max_queued,
        "queued": state.admission.num_queued, "open_requests": state.admission.num_open,
        "running": engine.load.num_running, "waiting": engine.load.num_waiting,
        "deterministic": state.deterministic,
        "speculative_ngram": state.speculative_ngram,
        "prefix_cache": {"enabled": state.prefix_cache,
                         "prompt_tokens": state.metrics.num_prompt_tokens,
                         "cached_tokens": state.metrics.num_cached_prompt_tokens},
        "adapters": [{"name": a.name, "id": a.adapter_id, "key": a.key, "strength": a.strength,
                      "pinned": state.catalog.is_pinned(a)} for a in state.catalog.served()],
        "adapter_slots": state.catalog.capacity.num_slots,
        "adapter_registry": {"digest": state.catalog.digest(), "loads": state.catalog.num_loads,
                             "unloads": state.catalog.num_unloads},
        "startup_s": round(startup.total_s, 3) if startup else None,
        "startup_phases_s": {name: round(seconds, 3) for name, seconds in startup.phases}
                            if startup else None,
    }


def is_ready(state, ranks) -> bool:
    return state.status == "serving" and bool(ranks) and all(r.state == "serving"
                                                             for r in ranks)
