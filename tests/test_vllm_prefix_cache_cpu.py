"""vLLM's prefix cache after new weights reach an engine that stayed awake: dropped before any token is
generated with them, either by the sync itself or, started earlier by retire_prefix_cache(), in the
background while the trainer trains (the sync then only collects it)."""
import pytest

from colomem.errors import ColomemError, PhaseOrderError
from fakes.vllm import make, trainer_weights
from fakes.vllm import fake_vllm  # noqa: F401  (autouse: vLLM's modules stubbed)


def resets(r) -> int:
    return r.llm.calls.count("reset_prefix_cache")


def test_a_retired_cache_is_dropped_before_the_sync_and_only_collected_by_it():
    r = make(sync_transport="listener")
    r.load_weights(trainer_weights(1).items(), version=1)
    r.generate([[1, 2, 3]], n=2, max_new_tokens=3)
    before = resets(r)
    r.retire_prefix_cache()
    r.retire_prefix_cache()                       # once is enough: a second call starts nothing more
    stats = r.load_weights(trainer_weights(2).items(), version=2)
    assert resets(r) == before + 1 and stats.prefix_reset_early
    # the sync after it (nothing retired) resets on its own again, as without retiring
    stats = r.load_weights(trainer_weights(3).items(), version=3)
    assert resets(r) == before + 2 and not stats.prefix_reset_early
    r.close()


def test_a_generate_after_retiring_fills_the_cache_again_so_the_sync_resets_it_itself():
    r = make(sync_transport="listener")
    r.load_weights(trainer_weights(1).items(), version=1)
    r.retire_prefix_cache()
    r.generate([[1, 2]], n=1, max_new_tokens=2)    # an evaluation, say, after the rollout
    before = resets(r)
    stats = r.load_weights(trainer_weights(2).items(), version=2)
    assert resets(r) == before + 1 and not stats.prefix_reset_early
    # order: retire's reset, then the generate, then the sync's own reset
    calls = [c for c in r.llm.calls if c == "reset_prefix_cache" or isinstance(c, tuple)]
    assert calls[-3:] == ["reset_prefix_cache", ("generate", None), "reset_prefix_cache"]
    r.close()


@pytest.fixture
def refusing():
    """An awake engine with weights version 1 whose vLLM refuses to reset, a reset already retired."""
    r = make(sync_transport="listener")
    r.load_weights(trainer_weights(1).items(), version=1)
    r.llm.reset_ok = False
    r.retire_prefix_cache()
    yield r
    r.close()


def test_a_refused_early_reset_fails_the_sync_instead_of_leaving_stale_blocks(refusing):
    r = refusing
    with pytest.raises(ColomemError, match="refused to reset its prefix cache after a weight sync"):
        r.load_weights(trainer_weights(2).items(), version=2)


def test_a_refused_early_reset_before_a_sleep_or_generate_is_harmless(refusing):
    r = refusing
    assert len(r.generate([[1, 2]], n=1, max_new_tokens=2)) == 1    # the generate fills the cache anyway
    r.retire_prefix_cache()
    r.sleep()                                                     # vLLM's sleep drops the cache itself
    assert str(r.llm.calls[-1]).startswith("sleep") and r.llm.calls[-2] == "reset_prefix_cache"


def test_only_an_awake_engine_retires_its_cache():
    r = make(sync_transport="listener")
    r.sleep()
    with pytest.raises(PhaseOrderError, match="retire_prefix_cache"):
        r.retire_prefix_cache()
    r.close()


def test_close_with_a_retired_cache_does_not_wait_for_it():
    r = make(sync_transport="listener")
    r.load_weights(trainer_weights(1).items(), version=1)
    llm = r.llm
    r.retire_prefix_cache()
    r.close()
    assert r.phase == "closed" and llm.shutdown_called and llm.calls.count("reset_prefix_cache") == 2


def test_a_sync_accounts_for_its_time_by_part_in_the_step_metrics():
    # where a sync's milliseconds go: the bridge's packs and the worker's ACKs, the prefix cache's reset, and
    # the rest (the trainer's side), each in the step's metrics
    from types import SimpleNamespace

    from colomem.runner.timeline import switch_metrics

    r = make(sync_transport="listener")
    r.load_weights(trainer_weights(1).items(), version=1)
    r.generate([[1, 2]], n=1, max_new_tokens=2)
    r.retire_prefix_cache()
    stats = r.load_weights(trainer_weights(2).items(), version=2)
    assert 0 < stats.ack_seconds <= stats.bridge_seconds <= stats.seconds
    assert stats.apply_seconds <= stats.ack_seconds       # the worker applies inside the wait for its ACK
    quiet = SimpleNamespace(last_offload=None, last_reload=None)
    m = switch_metrics(stats, quiet, SimpleNamespace(timings={}), moved=())
    for k in ("bridge_seconds", "pack_issue_seconds", "pack_copy_seconds", "pack_checksum_seconds",
              "pack_wait_seconds", "ack_seconds", "prefix_reset_seconds"):
        assert m[f"sync/{k}"] == getattr(stats, k)
    assert m["sync/prefix_reset_early"] is True
    r.close()
