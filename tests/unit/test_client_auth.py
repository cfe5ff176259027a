"""`client_auth.authorized`: a bearer token is one of the keys, exactly."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.client_auth import authorized

KEYS = ("sk-one", "sk-two-\u00e9")
token = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)


def test_a_bearer_token_that_is_a_key_passes() -> None:
    for key in KEYS:
        assert authorized(f"Bearer {key}", KEYS)
        assert authorized(f"bearer {key}", KEYS)  # the scheme is case-insensitive
        assert authorized(f"BEARER  {key} ", KEYS)


@given(token)
def test_anything_else_is_refused(guess: str) -> None:
    expected = guess.strip() in KEYS
    assert authorized(f"Bearer {guess}", KEYS) is expected
    assert not authorized(guess, KEYS) or guess.lower().startswith("bearer ")
    assert not authorized(f"Basic {guess}", KEYS)


@given(st.sampled_from(KEYS), st.integers(0, 5), token)
def test_a_key_cut_or_extended_is_refused(key: str, cut: int, tail: str) -> None:
    assert not authorized(f"Bearer {key[: len(key) - 1 - cut]}", KEYS)
    if tail.strip():
        assert not authorized(f"Bearer {key}{tail.strip()}", KEYS)
