"""The judge's chat workload: multi-turn conversations on a shared system prompt, both
engines with the prefix cache on, each pass from an empty cache; reported beside SpecScore."""

import pytest

from experiments import card as card_lib
from experiments import chat_workload, judge, judge_gate as gate
from judge_fixtures import write_judge_checkpoint

SPEC = chat_workload.ChatSpec(conversations=2, turns=2, system_tokens=32, user_tokens=8)
# fidelity_lanes = 2: the fidelity check fits the engines' 2 lane slots (the chat workload's
# team_lanes), so it runs on the judge's engine shape and reuses its prefill programs (as the
# default judge does) instead of compiling those of two 16-lane engines of its own.
TINY = dict(passes=1, workloads=("solo",), solo_requests=1, prompt_tokens=16, gate_prompts=2,
            max_new_tokens=6, fidelity_tokens=2, fidelity_lanes=2, progress=False, k=1,
            team_lanes=2, limits=gate.Limits(busy_page_use_floor=0.5))


def test_build_shares_the_system_prompt_and_varies_the_messages():
    texts = [([i] * 10, [100 + i] * 30) for i in range(5)]
    system, users = chat_workload.build(texts, SPEC)
    assert len(system) == 32 and system[:10] == [0] * 10
    assert len(users) == 2 and all(len(u) == 2 for u in users)
    assert users[0][0] != users[0][1] and users[0][0] != users[1][0]
    with pytest.raises(ValueError, match="too short"):
        chat_workload.build([([1], [2])], SPEC)


def test_judge_chat_workload_hits_the_cache_and_stays_lossless(tmp_path):
    ckpt = write_judge_checkpoint(str(tmp_path / "ckpt"), peaky=4.0)
    jc = judge.JudgeConfig(checkpoint=ckpt, out_dir=str(tmp_path / "out"), chat=SPEC, **TINY)
    card = judge.run_judge(jc)
    chat = card["chat"]
    assert set(card["ratios"]) == {"solo"}                    # SpecScore: solo/team/busy only
    for name in ("stock", "candidate"):
        pc = chat["prefix_cache"][name]
        # turn 2 of each conversation hits turn 1's prompt; turn 1 may hit the system prompt
        assert pc["lookups"] == SPEC.conversations * SPEC.turns
        assert pc["hits"] >= SPEC.conversations and pc["tokens_reused"] >= 2 * 32, pc
    assert chat["greedy_agreement"] == 1.0                    # float32 greedy: lossless
    assert chat["ratio"] > 0 and len(chat["ttft_ms_per_turn"]["stock"]) == SPEC.turns
    assert "Chat workload" in card_lib.render_md(card)
