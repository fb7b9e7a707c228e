"""Pipelined directory steps keep the state machine's compare-and-set semantics (real redis-server)."""

from __future__ import annotations

from kvwire.bench.directory import _location
from kvwire.connectors.directory.batch import DirectoryBatch
from kvwire.connectors.directory.directory import KVDirectory, TransferState


def test_batch_runs_the_same_checks_as_single_steps(redis_url):
    d = KVDirectory(redis_url, namespace="batch-test")
    try:
        d.create_pending("done", "p")
        d.transition("done", {TransferState.PENDING}, TransferState.FAILED, "gone")
        out = (DirectoryBatch(d).publish_ready(_location("a")).publish_ready(_location("done"))
               .get("a").get("missing")
               .transition("a", {TransferState.READY}, TransferState.CONSUMED)
               .transition("a", {TransferState.READY}, TransferState.CONSUMED)  # no longer READY
               .delete("a").execute())
        published_a, published_done, got_a, got_missing, cas1, cas2, deleted = out
        assert published_a and not published_done  # a FAILED entry cannot become READY
        assert got_a.state == TransferState.READY and got_a.location == _location("a") and got_missing is None
        assert cas1 and not cas2 and deleted is None
        assert d.get("a") is None and d.get("done").state == TransferState.FAILED
    finally:
        d.close()


def test_batch_is_one_round_trip_and_survives_a_server_that_forgot_its_scripts(redis_url):
    """Scripts travel as EVALSHA without redis-py's SCRIPT EXISTS round trip; after SCRIPT FLUSH (what a
    restarted server looks like) the NOSCRIPT steps are re-run with the script loaded, in order."""
    import redis

    d = KVDirectory(redis_url, namespace="batch-noscript")
    admin = redis.Redis.from_url(redis_url)
    try:
        assert DirectoryBatch(d).publish_ready(_location("warm")).execute() == [True]  # scripts loaded once
        before = admin.info("commandstats").get("cmdstat_script|exists", {}).get("calls", 0)
        assert DirectoryBatch(d).publish_ready(_location("x")).get("x").execute()[0] is True
        assert admin.info("commandstats").get("cmdstat_script|exists", {}).get("calls", 0) == before

        admin.script_flush()
        published, entry, consumed, deleted = (DirectoryBatch(d).publish_ready(_location("y")).get("y")
                                               .transition("x", {TransferState.READY}, TransferState.CONSUMED)
                                               .delete("warm").execute())
        assert published and consumed and deleted is None
        assert entry is None  # read in the batch, before the NOSCRIPT step was re-run
        assert d.get("y").state == TransferState.READY and d.get("x").state == TransferState.CONSUMED
        assert d.get("warm") is None
    finally:
        admin.close()
        d.close()
