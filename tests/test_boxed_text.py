"""Text drawn inside boxes (rich tracebacks, framed dumps): peeled into what the plain readers know."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainwatch.diagnostics.boxed_text import unbox
from trainwatch.diagnostics.explain import explain_inputs
from trainwatch.diagnostics.stack_parsers import parse_stack_text

# rich's traceback of a launcher that died in a collective: the long path is folded
# at the frame's width, another frame's function wrapped onto its own line.
RICH_COLLECTIVE = """\
[rank1]: ╭───────────────────── Traceback (most recent call last) ──────────────────────╮
[rank1]: │ /work/pretrain.py:212 in train_step                                          │
[rank1]: │                                                                              │
[rank1]: │   210 │   │   loss = model(batch)                                            │
[rank1]: │ ❱ 212 │   │   dist.all_reduce(loss)                                          │
[rank1]: │                                                                              │
[rank1]: │ /opt/conda/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:81  │
[rank1]: │ in wrapper                                                                   │
[rank1]: │                                                                              │
[rank1]: │ /opt/conda/lib/python3.11/site-packages/torch/distributed/distributed_c10d.p │
[rank1]: │ y:2501 in all_reduce                                                         │
[rank1]: │ ╭──────────────── locals ─────────────────╮                                  │
[rank1]: │ │ group = None                             │                                  │
[rank1]: │ ╰──────────────────────────────────────────╯                                  │
[rank1]: ╰──────────────────────────────────────────────────────────────────────────────╯
[rank1]: KeyboardInterrupt
"""

# A rich traceback cut mid-frame (the paste ends inside the box), waiting for a batch.
RICH_CUT_DATALOADER = """\
│ /home/u/venv/lib/python3.10/site-packages/torch/utils/data/dataloader.py:630 in  │
│ __next__                                                                         │
│                                                                                  │
│    627 │   │   │   if self._sampler_iter is None:                                │
│ ❱  630 │   │   │   data = self._next_data()                                      │
│                                                                                  │
│ in _next_data:1328                                                               │
│                                                                                  │
│   1325 │   │   │   idx, data = self._get_data()
"""

# A py-spy dump pasted inside a panel: the frames keep their own indentation.
FRAMED_PYSPY = """\
┌──────────────────────────────────────────────────────────────────────┐
│ Process 5150: python train.py                                        │
│ Python v3.10.12 (/usr/bin/python3.10)                                │
│                                                                      │
│ Thread 5150 (idle): "MainThread"                                     │
│     barrier (torch/distributed/distributed_c10d.py:3685)             │
│     save (trainer.py:88)                                             │
└──────────────────────────────────────────────────────────────────────┘
"""


def test_a_rich_traceback_reads_as_a_python_traceback():
    text = unbox(RICH_COLLECTIVE)
    assert "[rank1]: Traceback (most recent call last):" in text
    assert '[rank1]:   File "/work/pretrain.py", line 212, in train_step' in text
    assert ('[rank1]:   File "/opt/conda/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", '
            "line 81, in wrapper") in text
    # the folded path is whole again
    assert ('File "/opt/conda/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", '
            "line 2501, in all_reduce") in text
    # source lines, borders and the locals panel are gone; the exception stays
    assert "❱" not in text and "│" not in text and "group = None" in text
    (proc,) = parse_stack_text(text)
    (thread,) = proc.threads
    assert proc.rank == 1 and thread.exception == "KeyboardInterrupt"
    assert [f.function for f in thread.frames] == ["all_reduce", "wrapper", "train_step"]


def test_a_cut_rich_traceback_still_names_the_data_loader():
    (finding,) = explain_inputs([("tb.txt", RICH_CUT_DATALOADER.encode())])["findings"]
    assert (finding["kind"], finding["category"]) == ("stack", "dataloader")
    assert "_next_data" in finding["evidence"] or "__next__" in finding["evidence"]


def test_a_rich_frame_without_a_readable_file_keeps_its_function_and_line():
    assert unbox("│ in _next_data:1328   │") == '  File "", line 1328, in _next_data'


def test_a_framed_pyspy_dump_keeps_its_shape():
    (proc,) = parse_stack_text(unbox(FRAMED_PYSPY))
    assert proc.pid == 5150
    assert [f.function for f in proc.threads[0].frames] == ["barrier", "save"]
    (finding,) = explain_inputs([("dump.txt", FRAMED_PYSPY.encode())])["findings"]
    assert finding["category"] == "barrier"


def test_text_without_frames_is_unchanged_and_bars_inside_a_line_stay():
    plain = "step 10 │ loss 2.31 │ lr 3e-4\nRuntimeError: x │ y\n"
    assert unbox("no frames here\n") == "no frames here\n"
    assert unbox(plain) == plain


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(
    st.sampled_from((RICH_COLLECTIVE + RICH_CUT_DATALOADER + FRAMED_PYSPY).splitlines()),
    st.text(alphabet=st.sampled_from("│┃║╭╮╰╯─┌┐└┘├┤ ❱0123456789:/.py inabc[]()\t"), max_size=80),
    st.text(max_size=40),
), max_size=30))
def test_any_text_unboxes_without_raising(lines: list[str]) -> None:
    text = "\n".join(lines)
    out = unbox(text)
    assert isinstance(out, str)
    assert len(out.splitlines()) <= len(text.splitlines()) + 1
    parse_stack_text(out)


def test_long_framed_lines_are_read_in_one_pass():
    # Shapes that make open-ended patterns backtrack: long words of slashes, folded headers
    # continued line after line, borders around long runs of blanks. A quadratic reader
    # would run into the suite's timeout here.
    folded = "│ " + "/a" * 20_000 + "│\n"
    header = "│ " + "/a" * 20_000 + ".py:1 in" + " " * 20_000 + "│\n"
    border = "╭" + "─" * 100 + "a" + " " * 40_000 + "b" + "─" * 100 + "╮\n"
    out = unbox(folded * 20 + header + border + "│ " + "x " * 50_000 + "\n")
    assert out.count("\n") <= 23
