"""dsuf.gpu.timeline: how a replay's kernel timeline is attributed (pure Python; the bench's
--trace feeds it a real CUPTI timeline on the GPU)."""

from __future__ import annotations

from dsuf.gpu.timeline import Span, analyse, report


def test_time_is_split_into_alone_overlapped_and_idle():
    t = analyse([Span("a", 0, 10), Span("b", 5, 12, stream=1), Span("c", 15, 20), Span("c", 20, 21)])
    assert t.span == 21
    assert (t.kernels["a"].alone, t.kernels["b"].alone, t.kernels["c"].alone) == (5, 2, 6)
    assert t.overlapped == 5 and t.idle == 3
    assert t.kernels["c"].launches == 2 and t.kernels["c"].total == 6
    assert t.gaps == {("b", "c"): (1, 3)}


def test_a_kernel_starting_as_another_ends_neither_overlaps_nor_leaves_a_gap():
    t = analyse([Span("x", 0, 4), Span("y", 4, 9)])
    assert t.overlapped == 0 and t.idle == 0 and t.gaps == {}
    assert (t.kernels["x"].alone, t.kernels["y"].alone) == (4, 5)


def test_gaps_are_summed_by_the_kernels_around_them():
    spans = [Span("mix", 0, 2), Span("gemv", 3, 8), Span("mix", 10, 12), Span("gemv", 13, 18)]
    t = analyse(spans)
    assert t.gaps == {("mix", "gemv"): (2, 2), ("gemv", "mix"): (1, 2)}
    text = report(t)
    assert "| mix | gemv | 2 | 2.0 | 1.00 |" in text and "no kernel 4.0 µs (22 %)" in text


def test_an_empty_timeline():
    t = analyse([])
    assert t.span == 0 and t.kernels == {} and "span 0.0 µs" in report(t)


def test_a_kernel_launched_early_works_only_once_its_stream_predecessor_ends():
    """Programmatic dependent launch: `b` is resident (traced) from 2 but waits for `a` until 10;
    on another stream `c` really runs alongside `a`."""
    t = analyse([Span("a", 0, 10, stream=1), Span("b", 2, 14, stream=1), Span("c", 4, 6, stream=2)])
    assert t.kernels["b"].alone == 4 and t.kernels["a"].alone == 8 and t.overlapped == 2
    assert t.kernels["b"].total == 4  # its working time, not its time resident
