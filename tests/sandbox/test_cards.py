"""Card arithmetic of the sandbox: Luhn, PAR and network token numbers."""

from __future__ import annotations

import random

import pytest

from domain.tokens.cards import card_brand
from domain.tokens.cards import luhn_valid as platform_luhn_valid
from sandbox.cards import luhn_valid, network_token_number, payment_account_reference


def test_the_fast_luhn_check_agrees_with_the_platforms():
    generator = random.Random(7)
    numbers = [str(generator.randrange(10**11, 10**19)) for _ in range(20_000)]

    assert [luhn_valid(number) for number in numbers] == [platform_luhn_valid(number) for number in numbers]
    assert any(luhn_valid(number) for number in numbers)


def test_the_par_is_29_characters_deterministic_and_distinct_per_card():
    visa, mastercard = "4242424242424242", "5555555555554444"

    par = payment_account_reference(visa)

    assert len(par) == 29 and par.startswith("SBX1") and par.isalnum() and par.isupper()
    assert payment_account_reference(visa) == par != payment_account_reference(mastercard)
    assert visa not in par


@pytest.mark.parametrize(("pan", "brand"), [("4242424242424242", "visa"), ("5555555555554444", "mastercard")])
def test_network_token_numbers_are_fresh_luhn_valid_numbers_of_the_brand(pan, brand):
    numbers = {network_token_number(pan, brand) for _ in range(50)}

    assert len(numbers) == 50 and pan not in numbers
    assert all(len(number) == 16 and luhn_valid(number) and card_brand(number) == brand for number in numbers)
