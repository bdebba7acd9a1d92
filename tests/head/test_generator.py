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
    assert scanner.stopped
    assert scanner.text.startswith("one\n\n")  # what was generated, not what was released


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
