"""The package's one integer check for user input (raytrain_guard.errors.check_int)."""

from __future__ import annotations

import pickle

import pytest

from raytrain_guard.errors import InputError, PlanInputError, check_int


@pytest.mark.parametrize("value", [True, False, 1.0, "3", (), -1])
def test_bools_floats_text_and_values_below_the_bound_are_refused(value):
    with pytest.raises(InputError) as err:
        check_int("num_workers", value, fix="use None to let the guard size it")
    assert err.value.field == "num_workers" and err.value.value is value
    assert str(err.value) == (f"num_workers: must be an integer >= 0 (got {value!r}); use None "
                              "to let the guard size it")


def test_an_integer_at_or_above_the_bound_is_returned():
    assert check_int("batch_size", 1, at_least=1) == 1
    assert check_int("epoch", 0) == 0


def test_the_error_class_and_default_fix_follow_the_caller():
    with pytest.raises(PlanInputError) as err:
        check_int("--workers", 0, at_least=1, error=PlanInputError)
    assert err.value.fix == "set --workers to an integer >= 1"
    again = pickle.loads(pickle.dumps(err.value))       # crosses actor boundaries
    assert type(again) is PlanInputError and str(again) == str(err.value)


@pytest.mark.parametrize("text, want", [("8", 8), (" 8 ", 8), (3, 3)])
def test_text_parsers_get_the_whole_number_written(text, want):
    assert check_int("--workers", text, at_least=1, parse=True) == want


@pytest.mark.parametrize("text", ["0", "1.5", "eight", "", True])
def test_text_that_is_no_integer_in_range_is_refused_in_the_same_words(text):
    # the wording is check_int's, the value shown is the text as the user wrote it
    with pytest.raises(PlanInputError) as err:
        check_int("--workers", text, at_least=1, parse=True, error=PlanInputError,
                  fix="pass --workers as a positive integer, e.g. --workers 8")
    assert str(err.value) == (f"--workers: must be an integer >= 1 (got {text!r}); pass "
                              "--workers as a positive integer, e.g. --workers 8")


def test_a_none_is_shown_as_the_value_given():
    # InputError leaves a None value out of its line; check_int still says what it got
    with pytest.raises(InputError) as err:
        check_int("micro_batch", None, at_least=1, fix="pass the DataLoader's batch_size")
    assert err.value.value is None
    assert str(err.value) == ("micro_batch: must be an integer >= 1 (got None); pass the "
                              "DataLoader's batch_size")
