"""services/edge/attempt.py: what a request whose client left before its first token is billed of its prompt (issue
38, point 7): the prompt its engine reports computing, its cached share within that; a prompt a prefill worker
already computed whole."""

from services.edge.attempt import Usage
from tests.unit.test_attempt import KV, LEFT, drive, end, make_run, routed


def test_the_cached_share_is_within_the_prompt_the_engine_computed():
    run = make_run()  # 2 of its 4 prompt tokens were computed (a chunk), the engine reporting 3 of them cached
    drive(run, routed("w1"), LEFT, end("abort", prompt=2, cached=3, output=0))
    assert run.usage == Usage("cancelled", "abort", 0, "w1", "", 2, 2, 0, 0.0)


def test_a_prompt_the_engine_never_ran_bills_nothing_of_it():
    run = make_run()
    drive(run, routed("w1"), LEFT, end("abort", prompt=0, cached=0, output=0))
    assert run.usage == Usage("cancelled", "abort", 0, "w1", "", 0, 0, 0, 0.0)


def test_a_prompt_a_prefill_worker_computed_is_billed_whole_when_the_decode_never_ran():
    run = make_run()  # the prefill ended (3 cached there); the client left before the decode worker ran it
    drive(run, routed("w1", "p1"), end("remote", "r-prefill", cached=3, output=1, kv=KV), LEFT,
          end("abort", prompt=0, cached=0, output=0))
    assert run.usage == Usage("cancelled", "abort", 0, "w1", "p1", 4, 3, 0, 0.0)
