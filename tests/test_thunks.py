"""experiments/thunks.py on a handwritten thunk sequence in the layout XLA dumps (a deviceless
H200 compile's after-passes file): kernels under a command buffer are in a graph; those in a
conditional's branches and a loop's condition and body are not."""

from experiments.thunks import read_thunks, read_new

SEQ = """\
000: kCommandBuffer [source       | next=090 (1)] 
    001: kCustomKernel [source        | next=005 (4) ] loop_select_fusion_8 grid: [240, 1, 1]
    002: kCustomKernel [prev=001 (1)  | next=003 (1) ] rmsnorm_c1024 grid: [1, 1, 1]
    003: kCopy [prev=002 (1)  | next=004 (1) ] kCopy
090: kConditional   [prev=000 (1) | next=000 (1)]   
  false_branch:
    081: kCopy  [source       | next=083 (2)] kCopy
    083: kWhile [prev=082 (1) | sink        ]       
condition:
        084: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
      body:
        085: kCustomKernel [source       | next=086 (1)] input_reduce_fusion_2 grid: [64, 1, 1]
  true_branch:
    089: kCopy [source | sink] kCopy
000: kCommandBuffer [prev=090 (1) | sink        ] 
    004: kCustomKernel [source | sink] gated_delta_verify grid: [1, 48, 1]
"""


def test_kernels_in_and_outside_command_buffers():
    t = read_thunks(SEQ)
    assert (t.graphs, t.in_graphs, t.outside, t.control) == (2, 4, 4, 2)
    assert t.by_kind == {"kCustomKernel": 5, "kCopy": 3}


def test_without_command_buffers_everything_is_outside():
    plain = "\n".join(l[4:] if l.startswith("    0") else l
                      for l in SEQ.splitlines() if "kCommandBuffer" not in l)
    t = read_thunks(plain)
    assert (t.graphs, t.in_graphs) == (0, 0) and t.outside == 8


def test_read_new_prefers_the_after_passes_file(tmp_path):
    (tmp_path / "m.jit_f.thunk_sequence.txt").write_text(SEQ.replace("kCommandBuffer", "kX"))
    (tmp_path / "m.jit_f.thunk_sequence_after_thunk_passes.txt").write_text(SEQ)
    assert read_new(str(tmp_path), set())["graphs"] == 2
    assert read_new(str(tmp_path), {str(p) for p in tmp_path.iterdir()}) is None
