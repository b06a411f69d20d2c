"""services/batch/dispatch.py: the order batch lines go in, on a fake clock."""

from __future__ import annotations

import pytest

from services.batch.dispatch import Dispatcher, LineRef, prefix_order, prompt_text
from services.batch.lines import BatchLine


def chat(*messages: tuple[str, str]) -> dict:
    return {"model": "m", "messages": [{"role": role, "content": content} for role, content in messages]}


def job_lines(bodies: list[dict]) -> list[BatchLine]:
    return [BatchLine(i, f"r{i}", body, b"") for i, body in enumerate(bodies)]


def simple(n: int) -> list[BatchLine]:
    return job_lines([{"model": "m", "prompt": f"line {i}"} for i in range(n)])


def drain(d: Dispatcher, now: float = 0.0, n: int = 1000) -> list[tuple[str, int]]:
    return [tuple(ref) for ref in d.next(n, now)]


@pytest.mark.parametrize("jobs, expected_job_order", [
    ([("a", 300, 10), ("b", 200, 20), ("c", 100, 30)], ["c", "b", "a"]),  # earliest deadline first
    ([("a", 100, 20), ("b", 100, 10)], ["b", "a"]),  # same deadline: created first goes first
    ([("a", 100, 10), ("b", 100, 10)], ["a", "b"]),  # equal: added first goes first
])
def test_earliest_deadline_first_across_jobs(jobs, expected_job_order):
    d = Dispatcher()
    for job_id, expires_at, created_at in jobs:
        d.add_job(job_id, expires_at, created_at, simple(2))
    taken = drain(d)
    assert [job for job, _ in taken] == [job for job in expected_job_order for _ in range(2)]


def test_next_pops_at_most_n_and_continues_where_it_stopped():
    d = Dispatcher()
    d.add_job("late", 200, 0, simple(3))
    d.add_job("soon", 100, 0, simple(2))
    assert drain(d, n=3) == [("soon", 0), ("soon", 1), ("late", 0)]
    assert drain(d, n=3) == [("late", 1), ("late", 2)]
    assert drain(d, n=3) == [] and d.pending("late") == 0


def test_a_job_added_later_with_an_earlier_deadline_goes_next():
    d = Dispatcher()
    d.add_job("a", 500, 0, simple(3))
    assert drain(d, n=1) == [("a", 0)]
    d.add_job("b", 100, 1, simple(1))
    assert drain(d, n=2) == [("b", 0), ("a", 1)]


SYSTEM_A, SYSTEM_B = "You sort fruit. " * 20, "You write haiku. " * 20


@pytest.mark.parametrize("bodies, expected", [
    # two long system prompts interleaved in the file: each group goes together, in first-appearance order
    ([chat(("system", SYSTEM_A), ("user", "apple")), chat(("system", SYSTEM_B), ("user", "snow")),
      chat(("system", SYSTEM_A), ("user", "pear")), chat(("system", SYSTEM_B), ("user", "rain")),
      chat(("system", SYSTEM_A), ("user", "fig"))], [0, 2, 4, 1, 3]),
    # nothing shared: the file's order
    ([chat(("user", "one")), chat(("user", "two")), chat(("user", "three"))], [0, 1, 2]),
    # completions prompts sharing a few-shot preamble
    ([{"prompt": "Q: 1+1?" + "x" * 200}, {"prompt": "Translate: " + "y" * 200},
      {"prompt": "Q: 1+1?" + "x" * 200 + "!"}], [0, 2, 1]),
])
def test_lines_sharing_a_prefix_are_sent_together(bodies, expected):
    d = Dispatcher()
    d.add_job("j", 100, 0, job_lines(bodies))
    assert [i for _, i in drain(d)] == expected


def test_prefix_groups_nest_and_stay_contiguous_at_every_depth():
    a, b = "A" * 64, "B" * 64
    texts = [a + "1" * 64, b + "1" * 64, a + "2" * 64, b + "2" * 64, a + "1" * 64 + "tail", a + "2" * 64]
    order = prefix_order(texts)
    assert order == [0, 4, 2, 5, 1, 3]
    for depth in (1, 2):  # each group of equal first `depth` blocks is one run in the order
        keys = [texts[i][:64 * depth] for i in order]
        runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
        assert len(runs) == len(set(runs))


def test_prefix_order_is_stable_beyond_its_depth():
    same = "s" * (64 * 16)
    assert prefix_order([same + "b", same + "a", same]) == [0, 1, 2]


def test_prompt_text_renders_roles_and_text_parts():
    body = chat(("system", "S"), ("user", "U"))
    body["messages"].append({"role": "user", "content": [{"type": "text", "text": "T"}, {"type": "image_url"}]})
    assert prompt_text(body) == '<system>S\n<user>U\n<user>T{"type":"image_url"}\n'
    assert prompt_text({"prompt": [1, 2, 3]}) == "[1,2,3]"


def test_a_deferred_line_waits_until_its_time_then_goes_first_in_its_job():
    d = Dispatcher()
    d.add_job("j", 100, 0, simple(4))
    assert drain(d, now=0, n=2) == [("j", 0), ("j", 1)]
    d.defer("j", 1, until=5.0)  # a 429 with Retry-After: 5
    assert drain(d, now=4.9, n=1) == [("j", 2)]
    assert d.pending("j") == 2 and d.wake_at() == 5.0
    assert drain(d, now=5.0, n=1) == [("j", 1)]
    assert drain(d, now=5.0) == [("j", 3)] and d.wake_at() is None


def test_deferred_lines_come_back_by_their_until_and_do_not_block_other_jobs():
    d = Dispatcher()
    d.add_job("soon", 100, 0, simple(2))
    d.add_job("late", 200, 0, simple(1))
    assert drain(d, n=2) == [("soon", 0), ("soon", 1)]
    d.defer("soon", 1, until=9.0)
    d.defer("soon", 0, until=3.0)
    assert drain(d, now=1.0) == [("late", 0)]  # the earlier job's retries are not due: the next job's lines go
    assert drain(d, now=9.0) == [("soon", 0), ("soon", 1)]


def test_a_requeued_line_goes_again_at_once_ahead_of_fresh_lines():
    d = Dispatcher()
    d.add_job("j", 100, 0, simple(3))
    assert drain(d, n=1) == [("j", 0)]
    d.requeue("j", 0)
    assert drain(d, n=2) == [("j", 0), ("j", 1)]


def test_drop_job_forgets_its_lines_and_later_hand_backs():
    d = Dispatcher()
    d.add_job("a", 100, 0, simple(3))
    d.add_job("b", 200, 0, simple(1))
    assert drain(d, n=1) == [("a", 0)]
    d.defer("a", 0, until=1.0)
    assert d.drop_job("a") == 3 and d.pending("a") == 0 and d.drop_job("a") == 0
    d.requeue("a", 0)
    d.defer("a", 1, until=0.0)
    assert drain(d, now=2.0) == [("b", 0)] and d.wake_at() is None


def test_adding_a_job_twice_keeps_the_first():
    d = Dispatcher()
    d.add_job("j", 100, 0, simple(2))
    assert drain(d, n=1) == [("j", 0)]
    d.add_job("j", 100, 0, simple(2))
    assert d.pending("j") == 1 and d.next(5, 0.0) == [LineRef("j", 1)]


def test_shuffled_order_breaks_prefix_groups_the_same_way_for_the_same_job():
    bodies = [{"prompt": f"{'S' * 128}{k} question {q}"} for k in "ab" for q in range(20)]
    prefixed, shuffled, again = Dispatcher(), Dispatcher("shuffled"), Dispatcher("shuffled")
    for d in (prefixed, shuffled, again):
        d.add_job("j", 100, 0, job_lines(bodies))
    grouped, mixed = [i for _, i in drain(prefixed)], [i for _, i in drain(shuffled)]
    assert grouped == list(range(40)) and sorted(mixed) == grouped and mixed != grouped
    assert [i for _, i in drain(again)] == mixed  # seeded by the job's id
    switches = sum((a < 20) != (b < 20) for a, b in zip(mixed, mixed[1:], strict=False))
    assert switches > 5  # the two prefix groups interleave


def test_a_batch_config_refuses_an_unknown_dispatch_order():
    from services.batch.config import BatchConfig

    assert BatchConfig(dispatch_order="shuffled").dispatch_order == "shuffled"
    with pytest.raises(AssertionError):
        BatchConfig(dispatch_order="random")
