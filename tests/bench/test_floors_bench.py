"""``kvxferd bench floors``: each step is measured and printed."""

from kvxferd.bench import floors


def test_each_floor_is_measured():
    wakeups = floors.wakeups(seconds=0.2)
    assert set(wakeups) == {"threading.Event.wait", "Waker.wait (eventfd + select)", "time.sleep"}
    assert all(row["interval_us"] >= 100 and row["cpu_us_per_wake"] > 0 for row in wakeups.values())
    figures = {"wakeups_100us": wakeups, "thread_hop": floors.thread_hop(50),
               "nixl": floors.nixl_notifications(100), "grpc_stream": floors.grpc_stream(80),
               "planning_us": floors.planning(10)}
    assert figures["nixl"]["notification_one_way"]["p50_us"] > 0
    assert figures["grpc_stream"]["round_trip"]["p50_us"] > 0
    text = floors.format_table(figures)
    assert "gRPC aio stream" in text and "plan_request" in text
