"""The head's text front: what leaves for the client while stop strings may still match.

A client streaming a generation must never see text that a stop string later takes back,
and must see everything else as soon as no stop string can claim it (the end-to-end
equality with llama-cpp-python's ``create_completion`` lives in the pipeline tests).
"""

from __future__ import annotations

from skippy_stage.head.generator import StopScanner


def test_text_that_could_start_a_stop_string_is_held_back_until_it_cannot():
    scanner = StopScanner(("\nUser:",))
    assert scanner.feed("Paris is the capital") == "Paris is the capital"
    assert scanner.feed(".\nUs") == "."  # "\nUs" may become "\nUser:"
    assert scanner.feed("ually") == "\nUsually"  # it did not
    assert not scanner.stopped


def test_the_first_stop_string_ends_the_text_before_it():
    scanner = StopScanner(("END", "\n\n"))
    assert scanner.feed("one\n") == "one"
    assert scanner.feed("\ntwo END") == ""
    assert scanner.stopped and scanner.matched == "\n\n"
    assert scanner.text.startswith("one\n\n")  # what was generated, not what was released


def test_the_stop_string_found_is_named_the_first_listed_when_two_start_at_the_same_place():
    scanner = StopScanner(("late", "abc", "ab"))
    assert scanner.feed("xabc late") == "x"
    assert scanner.matched == "abc"
    assert StopScanner(("x",)).matched is None


def test_a_stop_string_split_across_many_pieces_is_still_caught():
    scanner = StopScanner(("<|end|>",))
    released = "".join(scanner.feed(piece) for piece in ["ok", "<", "|", "en", "d", "|>", "more"])
    assert released == "ok" and scanner.stopped


def test_without_stop_strings_everything_is_released_at_once_and_flush_adds_nothing():
    scanner = StopScanner(())
    assert scanner.feed("a") == "a" and scanner.feed("b") == "b"
    assert scanner.flush() == ""


def test_flush_releases_what_was_held_when_the_generation_ends():
    scanner = StopScanner(("STOP",))
    assert scanner.feed("wait ST") == "wait "
    assert scanner.flush() == "ST"


# -- n choices in one KV pool ----------------------------------------------------------


def test_n_choices_without_max_tokens_share_a_unified_kv_pool_instead_of_being_refused(smollm2, slice_cache):
    """In a unified KV pool one session may hold every cell, so n choices of "as many tokens as
    fit" could never be admitted together: each takes its share of the pool instead. Asked for
    explicitly, a max_tokens that cannot fit n times is refused naming n."""
    from dataclasses import replace

    import pytest
    from support.chain import split_configs

    from skippy_stage.errors import InvalidFieldError
    from skippy_stage.head.drafting import SpeculativeRequest
    from skippy_stage.head.generator import GenerateSpec, Generator, Piece
    from skippy_stage.model.sampling import SamplingParams
    from skippy_stage.stage.stage import Stage

    stages = []
    for cfg in split_configs(smollm2, [(0, 15), (15, 30)], slice_cache, n_threads=1, kv_unified=True):
        stage = Stage(replace(cfg, ctx_size=256, lane_count=2), max_message_bytes=cfg.max_message_bytes)
        stage.load()
        stages.append(stage)
    stages[0].connect_local(stages[1])
    generator = Generator(stages[0])
    try:
        assert generator.max_context == 256
        spec = GenerateSpec(prompt="The capital of France is", messages=(), max_tokens=256,
                            sampling=SamplingParams(temperature=0), stop=(), max_tokens_fit=True)
        tasks = generator.start(spec, 2)
        prompt = len(tasks[0].prompt)
        assert [t.max_tokens for t in tasks] == [128 - prompt] * 2
        texts = []
        for task in tasks:
            pieces = generator.pieces(task, spec, remaining_s=lambda: None)
            texts.append(next(p for p in pieces if isinstance(p, Piece) and p.text).text)
            pieces.close()
        assert texts[0] == texts[1]
        with pytest.raises(InvalidFieldError, match="n=2 choices"):
            generator.start(replace(spec, max_tokens_fit=False), 2)
        drafting = generator.start(replace(spec, speculative=SpeculativeRequest(drafter="ngram", k=4)), 2)
        assert [t.max_tokens for t in drafting] == [128 - prompt - 4] * 2  # room for a last step's drafts
        for task in drafting:
            task.cancel()
    finally:
        generator.close()
        for stage in stages:
            stage.close()


def test_tokens_that_wait_behind_the_first_reach_the_client_in_one_piece(smollm2, slice_cache):
    """A handler that fell behind the decode (the cores busy with it) sends every token already
    waiting in one message, not one message a token: each gRPC send costs the head hand-offs
    between threads. What it sends is unchanged: the same text, every token id in order, and the
    end that followed them."""
    from dataclasses import replace

    from support.chain import split_configs

    from skippy_stage.head.generator import Finish, GenerateSpec, Generator, Piece
    from skippy_stage.head.tasks import FINISH_LENGTH, End, Task, Tokens
    from skippy_stage.model.sampling import SamplingParams
    from skippy_stage.stage.stage import Stage

    (cfg,) = split_configs(smollm2, [(0, 30)], slice_cache, n_threads=1)
    stage = Stage(replace(cfg, ctx_size=256, lane_count=1), max_message_bytes=cfg.max_message_bytes)
    stage.load()
    generator = Generator(stage)
    try:
        ids = generator.runtime.tokenizer.tokenize(" one two three four", add_special=False)
        spec = GenerateSpec(prompt="x", messages=(), max_tokens=16, sampling=SamplingParams(temperature=0), stop=())
        task = Task(session_id="waiting", prompt=[1], sampling=spec.sampling, max_tokens=16)
        task.events.put(ids[0])
        task.events.put(Tokens(tuple(ids[1:3])))  # held by a stream interval
        for token in ids[3:]:
            task.events.put(token)
        task.events.put(End(FINISH_LENGTH))
        out = list(generator.pieces(task, spec, remaining_s=lambda: None))
        pieces = [p for p in out if isinstance(p, Piece)]
        assert [(p.text, p.token_ids) for p in pieces] == [(" one two three four", ids)]
        assert out[-1] == Finish(FINISH_LENGTH, 1, len(ids), "waiting")
    finally:
        generator.close()
        stage.close()
