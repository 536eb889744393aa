"""Kernel launches per program of Qwen3.5-27B on one H200 (tp = 1), counted in the optimized HLO
of a deviceless compile (experiments/hlo_audit.traffic: every scheduled kernel, loop trips
applied, the cheaper branch of a conditional). GENERATED, do not edit: regenerate with the
command in COMMANDS (experiments/aot.py --kernel_counts). Keyed by (weights, K, page_size),
then by the engine's program key (Engine.warmup_plan). Read by mtpjax/cost_model.py."""

COMMANDS = {
    ('bf16', 4, 16):
        'python -m experiments aot --kernel_counts --num_speculative_tokens=4 --kernel_lanes=1,32 --kernel_wide_depths=0,4 --kernel_prefill=64,512,2048 --out_dir=runs/aot_kernel_counts',
}

COUNTS = {
    ('bf16', 4, 16): {
        ('decode', 0, 1): 1661,
        ('decode', 0, 32): 1223,
        ('decode', 1, 1): 1340,
        ('decode', 2, 1): 1376,
        ('decode', 3, 1): 1688,
        ('decode', 4, 1): 1530,
        ('decode', 4, 32): 1375,
        ('draft', 1): 36,
        ('draft', 32): 28,
        ('move_lane',): 584,
        ('prefill', 64): 1452,
        ('prefill', 512): 1386,
        ('prefill', 2048): 1548,
        ('snapshot',): 96,
        ('snapshot_restore',): 97,
    },
}
