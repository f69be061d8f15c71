"""The connector's push params (issue #57): the decode leg's, checked, and refused in pull mode. vLLM-free."""

import pytest

from kvxferd.integrations.vllm.params import ParamsError, is_push, parse_push_prefill, push_hold_of
from kvxferd.integrations.vllm.scheduler import SchedulerSide
from kvxferd.integrations.vllm.settings import load_settings

LEG = {"do_remote_prefill": True, "kvxferd": 1, "kvxferd_push": True, "transfer_id": "t-1", "push_key": "ab" * 16,
       "remote_engine_id": "prefill", "remote_peer_addresses": ["127.0.0.1:4700"]}


@pytest.mark.parametrize("damage, field", [({"transfer_id": ""}, "transfer_id"), ({"kvxferd": 2}, "kvxferd"),
                                           ({"remote_peer_addresses": []}, "remote_peer_addresses"),
                                           ({"remote_engine_id": "a b"}, "remote_engine_id"),
                                           ({"push_key": "AB" * 16}, "push_key"), ({"push_key": None}, "push_key")])
def test_bad_push_params_are_refused_naming_the_field(damage, field):
    with pytest.raises(ParamsError, match=field):
        parse_push_prefill({**LEG, **damage})
    assert parse_push_prefill(LEG).transfer_id == "t-1" and is_push(LEG) and not is_push({"kvxferd": 1})
    assert parse_push_prefill(LEG).key() == bytes([0xAB] * 16)


@pytest.mark.parametrize("digest", [None, "", "ab" * 31, "AB" * 32, "zz" * 32, 7])
def test_a_push_prefill_leg_needs_the_digest_of_its_push_key(digest):
    leg = {"do_remote_decode": True, "kvxferd_transfer_id": "t-1", "kvxferd_push_digest": digest}
    with pytest.raises(ParamsError, match="kvxferd_push_digest"):
        push_hold_of(leg)
    assert push_hold_of({**leg, "kvxferd_push_digest": "ab" * 32}) == ("t-1", bytes([0xAB] * 32))  # the control
    assert push_hold_of({"do_remote_decode": True}) is None  # a pull's leg


def test_a_push_decode_leg_orders_an_expectation_of_the_uncached_blocks():
    scheduler = SchedulerSide("d", load_settings({"mode": "push"}))
    assert scheduler.matched_tokens("r", dict(LEG), 100, 32) == (68, True)  # 32 tokens cached locally
    scheduler.after_alloc("r", dict(LEG), ([7, 8, 9],), 68)
    (order,) = scheduler.take_orders()
    assert order.push and order.local_block_ids == ((7, 8, 9),) and order.remote["remote_num_tokens"] == 100


def test_push_params_in_pull_mode_are_a_failed_load():
    scheduler = SchedulerSide("d", load_settings({}))
    assert scheduler.matched_tokens("r", dict(LEG), 100, 0) == (100, True)  # vLLM hears of it: a failed load
    scheduler.after_alloc("r", dict(LEG), ([7],), 100)
    (order,) = scheduler.take_orders()
    assert order.remote is None and "pull mode" in order.error


def test_a_push_decode_leg_that_ends_unscheduled_lets_the_prefill_hold_go():
    scheduler = SchedulerSide("d", load_settings({"mode": "push"}))
    scheduler.finished_before_scheduled("r", dict(LEG))
    (order,) = scheduler.take_orders()
    assert order.push and not order.awaited and order.local_block_ids == ()
