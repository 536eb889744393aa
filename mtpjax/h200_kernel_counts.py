"""Per program of Qwen3.5-27B on one H200 (tp = 1), from its deviceless compile
(experiments/hlo_audit.traffic of the optimized HLO: every scheduled kernel, loop trips applied,
the cheaper branch of a conditional): COUNTS, the kernel launches (read by
mtpjax/cost_model.py); AUDIT, the HBM bytes the compiled program moves, with the context per lane
and the prefill start it was compiled at (tests/test_cost_model.py checks the cost model against
them, no compile needed). GENERATED, do not edit: regenerate by running the commands in COMMANDS
in order (experiments/aot.py --kernel_counts; each run merges its programs in). Keyed by
(weights, K, page_size), then by the engine's program key (Engine.warmup_plan)."""

COMMANDS = {
    ('bf16', 0, 16): (
        'python -m experiments aot --kernel_counts --num_speculative_tokens=0 --kernel_lanes=1,8,16 --kernel_prefill=16,64 --programs=decode_k0_b1,decode_k0_b8,decode_k0_b16,move_lane,snapshot_save,snapshot_restore,prefill_t64,prefill_t16 --out_dir=runs/aot_kc_k0',
    ),
    ('bf16', 1, 16): (
        'python -m experiments aot --kernel_counts --num_speculative_tokens=1 --kernel_lanes=1,8,16 --kernel_prefill=16,64 --programs=decode_k0_b1,decode_k1_b1,decode_k0_b8,decode_k1_b8,decode_k0_b16,decode_k1_b16,prefill_t16,prefill_t64,move_lane,snapshot_save,snapshot_restore --out_dir=runs/aot_kc_k1',
    ),
    ('bf16', 4, 16): (
        'python -m experiments aot --kernel_counts --num_speculative_tokens=4 --kernel_lanes=1,32 --kernel_wide_depths=0,4 --kernel_prefill=64,512,2048 --out_dir=runs/aot_kernel_counts',
        'python -m experiments aot --kernel_counts --num_speculative_tokens=4 --kernel_lanes=8,16 --kernel_wide_depths=0,4 --kernel_prefill=64 --programs=decode_k0_b8,decode_k4_b8,decode_k0_b16,decode_k4_b16,draft_b8,draft_b16 --out_dir=runs/aot_kc_k4_b8_16',
    ),
}

COUNTS = {
    ('bf16', 0, 16): {
        ('decode', 0, 1): 1707,
        ('decode', 0, 8): 1329,
        ('decode', 0, 16): 1313,
        ('move_lane',): 584,
        ('prefill', 16): 1516,
        ('prefill', 64): 1310,
        ('snapshot',): 96,
        ('snapshot_restore',): 97,
    },
    ('bf16', 1, 16): {
        ('decode', 0, 1): 1661,
        ('decode', 0, 8): 1221,
        ('decode', 0, 16): 1221,
        ('decode', 1, 1): 1430,
        ('decode', 1, 8): 1361,
        ('decode', 1, 16): 1361,
        ('move_lane',): 584,
        ('prefill', 16): 1543,
        ('prefill', 64): 1353,
        ('snapshot',): 96,
        ('snapshot_restore',): 97,
    },
    ('bf16', 4, 16): {
        ('decode', 0, 1): 1661,
        ('decode', 0, 8): 1222,
        ('decode', 0, 16): 1222,
        ('decode', 0, 32): 1223,
        ('decode', 1, 1): 1340,
        ('decode', 2, 1): 1376,
        ('decode', 3, 1): 1688,
        ('decode', 4, 1): 1530,
        ('decode', 4, 8): 1438,
        ('decode', 4, 16): 1440,
        ('decode', 4, 32): 1375,
        ('draft', 1): 36,
        ('draft', 8): 28,
        ('draft', 16): 28,
        ('draft', 32): 28,
        ('move_lane',): 584,
        ('prefill', 64): 1452,
        ('prefill', 512): 1386,
        ('prefill', 2048): 1548,
        ('snapshot',): 96,
        ('snapshot_restore',): 97,
    },
}

AUDIT = {
    ('bf16', 0, 16): {
        ('decode', 0, 1): (51772977468, 1024, 0),
        ('decode', 0, 8): (55969062330, 1024, 0),
        ('decode', 0, 16): (60544658738, 1024, 0),
        ('move_lane',): (629221704, 1024, 0),
        ('prefill', 16): (56087941668, 1024, 1008),
        ('prefill', 64): (59651655344, 1024, 960),
        ('snapshot',): (308871936, 1024, 0),
        ('snapshot_restore',): (307888904, 1024, 0),
    },
    ('bf16', 1, 16): {
        ('decode', 0, 1): (51783073655, 1024, 0),
        ('decode', 0, 8): (56124093898, 1024, 0),
        ('decode', 0, 16): (60919480146, 1024, 0),
        ('decode', 1, 1): (55484778924, 1024, 0),
        ('decode', 1, 8): (60948115018, 1024, 0),
        ('decode', 1, 16): (67180951698, 1024, 0),
        ('move_lane',): (642664800, 1024, 0),
        ('prefill', 16): (59494422399, 1024, 1008),
        ('prefill', 64): (63366561615, 1024, 960),
        ('snapshot',): (309854976, 1024, 0),
        ('snapshot_restore',): (307888904, 1024, 0),
    },
    ('bf16', 4, 16): {
        ('decode', 0, 1): (51806187407, 1024, 0),
        ('decode', 0, 8): (56309003922, 1024, 0),
        ('decode', 0, 16): (61289300194, 1024, 0),
        ('decode', 0, 32): (71188441794, 1024, 0),
        ('decode', 1, 1): (55535761603, 1024, 0),
        ('decode', 2, 1): (59186715972, 1024, 0),
        ('decode', 3, 1): (62821887516, 1024, 0),
        ('decode', 4, 1): (66343382777, 1024, 0),
        ('decode', 4, 8): (76064843170, 1024, 0),
        ('decode', 4, 16): (82995954258, 1024, 0),
        ('decode', 4, 32): (91883484706, 1024, 0),
        ('draft', 1): (3402270952, 1024, 0),
        ('draft', 8): (3470485640, 1024, 0),
        ('draft', 16): (3544549648, 1024, 0),
        ('draft', 32): (3688447520, 1024, 0),
        ('move_lane',): (682994064, 1024, 0),
        ('prefill', 64): (73585292160, 1024, 960),
        ('prefill', 512): (90540828604, 1024, 512),
        ('prefill', 2048): (169446015176, 1024, 0),
        ('snapshot',): (312804096, 1024, 0),
        ('snapshot_restore',): (307888904, 1024, 0),
    },
}
