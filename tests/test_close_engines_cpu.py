"""close_engines: the order the rollout and the trainer close in, and every part closed when one fails."""
import pytest

from colomem.runner.backends import Engines, close_engines


class Part:
    def __init__(self, name, order, fail=False, **attrs):
        self.name, self.order, self.fail = name, order, fail
        self.__dict__.update(attrs)

    def close(self, force=False):
        self.order.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} would not close")


@pytest.mark.parametrize("in_process, shared, first", [
    (False, None, "rollout"),          # an engine in a process of its own: it goes first
    (True, None, "trainer"),           # in this process: its shutdown takes the default process group along
    (False, object(), "trainer"),      # a shared base: the trainer reads the engine's weights
])
def test_the_trainer_closes_first_where_the_engine_lives_in_its_process_or_holds_its_base(in_process, shared, first):
    order: list = []
    e = Engines(rollout=Part("rollout", order, engine_in_process=in_process), trainer=Part("trainer", order),
                pool=Part("pool", order), shared=shared)
    assert close_engines(e) == []
    assert order[0] == first and sorted(order) == ["pool", "rollout", "trainer"] and order[-1] == "pool"
    assert e.rollout is None and e.trainer is None and e.pool is None


def test_a_part_that_fails_to_close_leaves_the_others_closed_and_is_reported():
    order: list = []
    said: list = []
    e = Engines(rollout=Part("rollout", order, fail=True, engine_in_process=True), trainer=Part("trainer", order),
                pool=Part("pool", order))
    errors = close_engines(e, said.append)
    assert order == ["trainer", "rollout", "pool"]
    assert errors == said and len(errors) == 1 and "closing the rollout failed" in errors[0]
