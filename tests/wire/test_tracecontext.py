"""W3C traceparent as kvxferd takes it from a socket (issue #60): only the exact version-00 form."""

from hypothesis import given, strategies as st

from kvxferd.wire.tracecontext import check_traceparent, traceparent_of

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_otel_a_version_00_traceparent_is_kept_and_anything_else_dropped():
    assert check_traceparent(GOOD) == GOOD
    assert check_traceparent(GOOD[:-2] + "00") == GOOD[:-2] + "00"  # not sampled: still a context
    for bad in ("", GOOD.upper(), GOOD + "-", " " + GOOD[1:], "01" + GOOD[2:], GOOD.replace("4bf9", "4bfg"),
                f"00-{'0' * 32}-00f067aa0ba902b7-01", f"00-4bf92f3577b34da6a3ce929d0e0e4736-{'0' * 16}-01",
                GOOD.replace("-", "_"), GOOD + "\n"):
        assert check_traceparent(bad) == "", bad
    assert traceparent_of({"traceparent": GOOD, "tracestate": "x=1"}) == GOOD
    assert traceparent_of(None) == traceparent_of({}) == traceparent_of({"traceparent": 7}) == ""


@given(st.text(max_size=80))
def test_otel_no_other_text_passes(text):
    kept = check_traceparent(text)
    assert kept in ("", text)
    if kept:
        assert len(text) == 55 and text[:3] == "00-" and text == text.lower()
