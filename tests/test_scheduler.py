"""The engine's host side with no model and nothing compiled: admission, grouping, chunk order, delivery."""

import ast
import inspect
from types import SimpleNamespace

import numpy as np
import pytest

from gpt.inference import completion as completion_module
from gpt.inference import scheduler as scheduler_module
from gpt.inference.completion import Completion
from gpt.inference.decoding import NO_TOKEN
from gpt.inference.request import Request
from gpt.inference.scheduler import Chunked, EngineStopped, QueueFull, Scheduler


def completion(prompt_length: int, max_tokens: int = 8, **fields) -> Completion:
    return Completion(Request(list(range(1, prompt_length + 1)), max_tokens, **fields))


def emitted(tokens_SR, live_R, stopped_SR=None) -> SimpleNamespace:
    """A decode's output as the device gives it: [steps, rows]."""
    token = np.asarray(tokens_SR, np.int32)
    return SimpleNamespace(token=token, steps=token.shape[0], count=(token != NO_TOKEN).sum(0),
                           logprob=np.full(token.shape, -0.5, np.float32),
                           live=np.asarray(live_R, np.bool_),
                           stopped=np.zeros(token.shape, np.bool_) if stopped_SR is None else np.asarray(stopped_SR))


def test_the_waiting_enter_free_slots_first_come_and_are_grouped_shortest_first():
    scheduler = Scheduler(num_slots=3, max_queue=8, rows_per_prefill=1, prefill_chunk=16)
    waiting = [completion(n) for n in (12, 40, 3, 5)]
    for c in waiting:
        scheduler.submit(c)
    groups = scheduler.admit()
    # The first three that came take the three slots; their prompts run shortest first; the 40-token one
    # is longer than a chunk.
    assert [(way, [(slot, len(c.request.prompt)) for slot, c in group]) for way, group in groups] == [
        ("whole", [(0, 3)]), ("whole", [(1, 12)]), ("chunked", [(2, 40)])]
    assert scheduler.owners == [waiting[2], waiting[0], waiting[1]] and list(scheduler.queue) == [waiting[3]]
    assert scheduler.admit() == []  # no slot is free


def test_a_mesh_prefills_rows_together_and_scored_prompts_go_through_the_prefix_cache():
    scheduler = Scheduler(num_slots=4, max_queue=8, rows_per_prefill=2, prefill_chunk=16)
    for n in (4, 20, 2, 6):
        scheduler.submit(completion(n))
    assert [(way, [len(c.request.prompt) for _, c in group]) for way, group in scheduler.admit()] == [
        ("whole", [2, 4]), ("chunked", [6, 20])]
    prefix_cached = Scheduler(num_slots=3, max_queue=8, prefix_cached=True)
    prefix_cached.submit(completion(4, prompt_logprobs=True))
    prefix_cached.submit(completion(3))
    prefix_cached.submit(completion(5, reuse_prefix=True))  # a conversation's turn: unscored, and reused
    assert [way for way, _ in prefix_cached.admit()] == ["whole", "prefix_cached", "prefix_cached"]


def test_the_queue_is_bounded_a_stopping_scheduler_admits_nothing_and_a_cancelled_wait_ends_there():
    scheduler = Scheduler(num_slots=1, max_queue=2)
    first, second = completion(3), completion(3)
    scheduler.submit(first)
    scheduler.submit(second)
    with pytest.raises(QueueFull, match="2 requests are waiting already"):
        scheduler.submit(completion(3))
    first.cancel()
    assert [[c for _, c in group] for _, group in scheduler.admit()] == [[second]]
    assert first.finish_reason == "cancelled" and first.done.is_set() and scheduler.queue_depth == 0
    scheduler.stopping = True
    with pytest.raises(EngineStopped):
        scheduler.submit(completion(3))


def test_delivery_hands_out_tokens_and_frees_the_slots_that_ended():
    scheduler = Scheduler(num_slots=3, max_queue=8)
    long, short, stopper = completion(2, max_tokens=8), completion(2, max_tokens=2), completion(2, stop_tokens=[7])
    for c in (long, short, stopper):
        scheduler.submit(c)
    scheduler.admit()
    slots = [scheduler.owners.index(c) for c in (long, short, stopper)]
    updates = []
    long.on_update = updates.append
    # Two steps: `long` goes on, `short` reaches its length, `stopper` draws its stop token at the second.
    tokens = np.full((2, 3), NO_TOKEN)
    stopped = np.zeros((2, 3), bool)
    tokens[:, slots[0]], tokens[:, slots[1]], tokens[:, slots[2]] = [11, 12], [21, 22], [31, 7]
    stopped[1, slots[2]] = True
    live = np.ones(3, bool)
    live[[slots[1], slots[2]]] = False
    scheduler.deliver([0, 1, 2], emitted(tokens, live, stopped))
    assert long.tokens == [11, 12] and updates == [long] and long.finish_reason is None
    assert short.tokens == [21, 22] and short.finish_reason == "length"
    assert stopper.tokens == [31] and stopper.stop_token[0] == 7 and stopper.finish_reason == "stop"
    assert scheduler.owners[slots[0]] is long and scheduler.live_slots == 1 and scheduler.tokens_emitted == 5
    assert scheduler.take_frees()[[slots[1], slots[2]]].all() and not scheduler.take_frees().any()


def test_a_stop_string_ends_the_request_and_stops_its_slot_at_the_next_round():
    scheduler = Scheduler(num_slots=1, max_queue=1)
    c = completion(2, stop_strings=["!"])
    scheduler.submit(c)
    scheduler.admit()
    scheduler.deliver([0], emitted([[0], [0]], [True]))  # token 0 is "!": the first ends it
    assert c.tokens == [0] and c.finish_reason == "stop" and c.cancel_requested
    scheduler.release_cancelled()
    assert scheduler.live_slots == 0 and scheduler.take_frees()[0]


def test_chunked_groups_run_oldest_first_and_a_group_whose_requests_went_is_dropped():
    scheduler = Scheduler(num_slots=3, max_queue=8, rows_per_prefill=1, prefill_chunk=16)
    for n in (40, 50):
        scheduler.submit(completion(n))
    for _, group in scheduler.admit():
        scheduler.add_chunked(Chunked(group, prefix=None))
    assert scheduler.prefilling() == {0, 1} and scheduler.decoding() == []
    scheduler.owners[0].cancel()
    scheduler.release_cancelled()
    group, entries = scheduler.next_chunked()
    assert [len(c.request.prompt) for _, c in entries] == [50] and len(scheduler.chunked) == 1  # the 40 went
    group, entries = scheduler.next_chunked()
    assert entries == [(1, scheduler.owners[1])]
    scheduler.finish_chunked()
    assert scheduler.next_chunked() is None and scheduler.decoding() == [1]


def test_a_request_of_one_token_enters_no_slot():
    scheduler = Scheduler(num_slots=2, max_queue=2)
    one, more = completion(3, max_tokens=1), completion(3, max_tokens=4)
    scheduler.free_S[:] = True
    assert scheduler.entering([0, 1], [one, more]) == [None, 1] and scheduler.free_S.tolist() == [True, False]


def test_the_scheduler_and_completions_hold_no_jax():
    for module in (scheduler_module, completion_module):
        tree = ast.parse(inspect.getsource(module))
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any(name.split(".")[0] in ("jax", "flax") for name in imported), (module.__name__, imported)


def test_a_request_cancelled_while_it_waits_leaves_the_queue_at_once_and_shutdown_aborts_the_rest():
    scheduler = Scheduler(num_slots=1, max_queue=2)
    running, waiting, gone = completion(3), completion(3), completion(3)
    scheduler.submit(running)
    scheduler.admit()
    scheduler.submit(waiting)
    scheduler.submit(gone)
    gone.cancel()  # its client went: it holds no place in the queue any more
    assert scheduler.queue_depth == 1 and gone.finish_reason == "cancelled" and gone.done.is_set()
    scheduler.submit(completion(3))  # a new client gets the place (no QueueFull)
    scheduler.cancel_everything("abort")
    assert waiting.finish_reason == "abort" and scheduler.queue_depth == 0
    scheduler.release_cancelled()
    assert running.finish_reason == "abort" and scheduler.live_slots == 0
