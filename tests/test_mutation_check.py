"""The mutation check's snippets and test names stay current (running it takes minutes: see its docstring)."""

from __future__ import annotations

import pytest

from tests.mutation_check import MUTATIONS, check, main


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_still_applies_to_the_source_and_names_existing_tests(mutation) -> None:
    assert check(mutation) is None


def test_an_unknown_mechanism_is_refused_with_the_names_known(capsys) -> None:
    assert main(["--only", "nope", "--list"]) == 2
    assert "unknown mechanism nope; known: " in capsys.readouterr().err
