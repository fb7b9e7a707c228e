"""One pull for all the requests of a vLLM server that name one producer's KV (connectors/vllm/shared_pulls.py): the
others wait until the puller is scheduled again (its blocks in the prefix cache) or ended, then pull nothing."""

from __future__ import annotations

from kvwire.connectors.vllm import shared_pulls
from kvwire.connectors.vllm.shared_pulls import SharedPulls


def test_the_others_wait_for_the_first_pull_until_it_is_scheduled_again():
    shared = SharedPulls()
    assert not shared.must_wait("k", "0_r") and not shared.pulled("k")  # nobody pulls it yet
    shared.pulling("k", "0_r")
    assert not shared.must_wait("k", "0_r") and shared.must_wait("k", "1_r") and not shared.pulled("k")
    shared.scheduled({"other"})  # a step without it: its pull goes on
    assert shared.must_wait("k", "1_r")
    shared.scheduled({"other", "0_r"})  # scheduled after its pull: its blocks are cached
    assert not shared.must_wait("k", "1_r") and shared.pulled("k") and not shared.pulled("k2")


def test_a_puller_that_ends_first_releases_the_others():
    shared = SharedPulls()
    shared.pulling("k", "0_r")
    shared.ended("1_r")
    assert shared.must_wait("k", "2_r")
    shared.ended("0_r")  # aborted mid-pull: the others go on (they compute what the cache lacks, counted)
    assert not shared.must_wait("k", "2_r") and shared.pulled("k")


def test_pulled_keys_are_remembered_up_to_a_bound(monkeypatch):
    monkeypatch.setattr(shared_pulls, "MAX_PULLED", 2)
    shared = SharedPulls()
    for i in range(3):
        shared.pulling(f"k{i}", f"r{i}")
        shared.ended(f"r{i}")
    assert [shared.pulled(f"k{i}") for i in range(3)] == [False, True, True]
