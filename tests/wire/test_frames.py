"""Frames of the reads socket: any cut of a stream of frames gives back the payloads; a length over the
limit is refused as soon as its header is in."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.errors import ResourceExhaustedError
from kvxferd.wire.frames import HEADER, FrameReader, encode_frame, reads_socket_path


@given(payloads=st.lists(st.binary(max_size=300), max_size=12), cuts=st.lists(st.integers(0, 4000), max_size=20))
def test_any_cut_of_the_stream_gives_the_payloads_back_in_order(payloads, cuts):
    stream = b"".join(encode_frame(p) for p in payloads)
    edges = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    reader, got = FrameReader(300), []
    for start, end in zip(edges, edges[1:]):
        got += reader.feed(stream[start:end])
    assert got == payloads and reader.num_buffered_bytes == 0


def test_a_frame_over_the_limit_is_refused_from_its_header_alone():
    reader = FrameReader(100)
    assert reader.feed(encode_frame(b"x" * 100)) == [b"x" * 100]
    assert reader.feed(HEADER.pack(101)[:3]) == []  # half a header: nothing to judge yet
    with pytest.raises(ResourceExhaustedError, match="101 bytes"):
        reader.feed(HEADER.pack(101)[3:])


def test_the_reads_socket_lives_next_to_the_engine_socket():
    assert reads_socket_path("/run/kvxferd/d0.sock") == "/run/kvxferd/d0.sock.reads"
