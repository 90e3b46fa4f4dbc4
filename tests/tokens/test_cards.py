"""Unit tests for domain.tokens.cards: Luhn, brands, masking, card and bank validation."""

from __future__ import annotations

import datetime

import pytest

from domain.tokens.cards import (
    DEFAULT_FINGERPRINT_EXPRESSIONS,
    aba_checksum_valid,
    bin_of,
    card_brand,
    default_bank_mask,
    default_card_mask,
    last4,
    luhn_valid,
    mask_pan,
    validate_bank,
    validate_card,
)
from domain.tokens.expressions import apply_mask, make_context, render, validate_mask

pytestmark = pytest.mark.unit

TODAY = datetime.date(2025, 6, 15)
VISA = "4242424242424242"


# --- Luhn ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "number",
    [VISA, "5555555555554444", "378282246310005", "6011111111111117", "3566002020360505", "79927398713"],
)
def test_luhn_valid_numbers(number):
    assert luhn_valid(number) is True


@pytest.mark.parametrize(
    "number",
    [
        "4242424242424241",
        "79927398710",
        "1234567812345678",
        "",
        "0",
        "4242 4242 4242 4242",
        "4242-4242",
        "abc",
    ],
)
def test_luhn_invalid_numbers(number):
    assert luhn_valid(number) is False


@pytest.mark.parametrize("value", [None, 4242424242424242, b"4242424242424242", "\uff14\uff12\uff14\uff12"])
def test_luhn_rejects_non_ascii_digit_strings(value):
    assert luhn_valid(value) is False


# --- brands -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("number", "brand"),
    [
        (VISA, "visa"),
        ("4000056655665556", "visa"),
        ("5555555555554444", "mastercard"),
        ("5105105105105100", "mastercard"),
        ("2223003122003222", "mastercard"),
        ("2221000000000009", "mastercard"),
        ("2720990000000007", "mastercard"),
        ("378282246310005", "amex"),
        ("371449635398431", "amex"),
        ("3566002020360505", "jcb"),
        ("6011111111111117", "discover"),
        ("6445644564456445", "discover"),
        ("6500000000000002", "discover"),
        ("3056930009020004", "diners"),
        ("36227206271667", "diners"),
        ("6200000000000005", "unionpay"),
        ("6759649826438453", "maestro"),
        ("5018000000000009", "maestro"),
    ],
)
def test_card_brand(number, brand):
    assert card_brand(number) == brand


@pytest.mark.parametrize(
    "number",
    ["2220990000000000", "2721000000000004", "9999999999999995", "1234567890123", "", "4242-4242", None, 42],
)
def test_card_brand_unknown(number):
    assert card_brand(number) is None


# --- bin, last4, mask ---------------------------------------------------------------------------


def test_bin_of_and_last4():
    assert bin_of(VISA) == "424242"
    assert bin_of(VISA, length=8) == "42424242"
    assert bin_of("4242", 6) == "4242"
    assert last4(VISA) == "4242"
    assert last4("123") == "123"


@pytest.mark.parametrize(("number", "length"), [("4242-4242", 6), (None, 6), (VISA, 0), (VISA, True)])
def test_bin_of_rejects_bad_input(number, length):
    with pytest.raises(ValueError):
        bin_of(number, length)


def test_last4_rejects_non_string():
    with pytest.raises(ValueError):
        last4(4242)


@pytest.mark.parametrize(
    ("number", "masked"),
    [
        (VISA, "424242XXXXXX4242"),
        ("378282246310005", "378282XXXXX0005"),
        ("4242424242424242424", "424242XXXXXXXXX2424"),
        ("4222222222222", "422222XXX2222"),
        ("123456789012", "XXXXXXXX9012"),
        ("12345", "X2345"),
        ("1234", "XXXX"),
        ("", ""),
    ],
)
def test_mask_pan(number, masked):
    assert mask_pan(number) == masked
    assert len(mask_pan(number)) == len(number)


def test_mask_pan_rejects_non_string():
    with pytest.raises(ValueError):
        mask_pan(4242424242424242)


# --- card validation ----------------------------------------------------------------------------


def full_card(**overrides):
    card = {
        "number": VISA,
        "expiration_month": 12,
        "expiration_year": 2030,
        "cvc": "123",
        "name": "Ada Lovelace",
    }
    card.update(overrides)
    return card


def test_valid_card_is_returned_normalised():
    data, errors = validate_card(full_card(), today=TODAY)
    assert errors == {}
    assert data == full_card()


def test_number_only_card_is_valid_and_keeps_only_given_keys():
    data, errors = validate_card({"number": VISA}, today=TODAY)
    assert errors == {}
    assert data == {"number": VISA}


def test_null_optional_fields_are_treated_as_absent():
    data, errors = validate_card(
        {"number": VISA, "cvc": None, "name": None, "expiration_month": None, "expiration_year": None},
        today=TODAY,
    )
    assert errors == {}
    assert data == {"number": VISA}


def test_validated_data_is_a_new_dict():
    source = full_card()
    data, _ = validate_card(source, today=TODAY)
    assert data is not source


@pytest.mark.parametrize("data", [None, "4242424242424242", [VISA], 42])
def test_card_data_must_be_an_object(data):
    normalised, errors = validate_card(data, today=TODAY)
    assert normalised is None
    assert errors == {"data": ["must be an object"]}


def test_missing_number():
    data, errors = validate_card({"expiration_month": 12, "expiration_year": 2030}, today=TODAY)
    assert data is None
    assert errors == {"data.number": ["is required"]}


@pytest.mark.parametrize(
    ("number", "fragment"),
    [
        ("4242abcd42424242", "digits only"),
        ("4242 4242 4242 4242", "digits only"),
        ("4242-4242-4242-4242", "digits only"),
        ("", "digits only"),
        ("42424242424", "12 to 19"),
        ("42424242424242424242", "12 to 19"),
        ("4242424242424241", "Luhn"),
        (4242424242424242, "must be a string"),
    ],
)
def test_bad_numbers(number, fragment):
    data, errors = validate_card({"number": number}, today=TODAY)
    assert data is None
    assert list(errors) == ["data.number"]
    assert len(errors["data.number"]) == 1
    assert fragment in errors["data.number"][0]


def test_error_messages_do_not_echo_the_number():
    _, errors = validate_card({"number": "4242424242424241"}, today=TODAY)
    assert "4242424242424241" not in repr(errors)


@pytest.mark.parametrize("month", [0, 13, -1])
def test_month_out_of_range(month):
    data, errors = validate_card(full_card(expiration_month=month), today=TODAY)
    assert data is None
    assert errors == {"data.expiration_month": ["must be between 1 and 12"]}


@pytest.mark.parametrize("month", [True, False, "12", 12.0])
def test_month_must_be_a_real_integer(month):
    _, errors = validate_card(full_card(expiration_month=month), today=TODAY)
    assert errors == {"data.expiration_month": ["must be an integer"]}


@pytest.mark.parametrize(
    ("year", "message"),
    [
        (True, "must be an integer"),
        ("2030", "must be an integer"),
        (30, "must be a four-digit year"),
        (20300, "must be a four-digit year"),
    ],
)
def test_year_rules(year, message):
    _, errors = validate_card(full_card(expiration_year=year), today=TODAY)
    assert errors == {"data.expiration_year": [message]}


def test_expired_card():
    data, errors = validate_card(full_card(expiration_month=5, expiration_year=2025), today=TODAY)
    assert data is None
    assert set(errors) == {"data.expiration_month", "data.expiration_year"}
    assert all("expired" in messages[0] for messages in errors.values())


def test_expired_in_an_earlier_year():
    _, errors = validate_card(full_card(expiration_month=12, expiration_year=2024), today=TODAY)
    assert "expired" in errors["data.expiration_year"][0]


def test_card_is_valid_through_the_last_day_of_its_month():
    data, errors = validate_card(full_card(expiration_month=6, expiration_year=2025), today=TODAY)
    assert errors == {}
    assert data["expiration_month"] == 6
    _, errors = validate_card(full_card(expiration_month=6, expiration_year=2025), today=datetime.date(2025, 6, 30))
    assert errors == {}
    _, errors = validate_card(full_card(expiration_month=6, expiration_year=2025), today=datetime.date(2025, 7, 1))
    assert errors


def test_month_without_year():
    card = full_card()
    del card["expiration_year"]
    data, errors = validate_card(card, today=TODAY)
    assert data is None
    assert errors == {"data.expiration_year": ["is required when expiration_month is given"]}


def test_year_without_month():
    card = full_card()
    del card["expiration_month"]
    _, errors = validate_card(card, today=TODAY)
    assert errors == {"data.expiration_month": ["is required when expiration_year is given"]}


def test_unknown_key_is_named():
    data, errors = validate_card(full_card(pin="1234"), today=TODAY)
    assert data is None
    assert list(errors) == ["data.pin"]
    assert "'pin'" in errors["data.pin"][0]


@pytest.mark.parametrize("cvc", ["12", "12345", "", "12a", "1 23"])
def test_bad_cvc(cvc):
    _, errors = validate_card(full_card(cvc=cvc), today=TODAY)
    assert list(errors) == ["data.cvc"]


def test_cvc_sent_as_a_number_is_taken_as_its_digits():
    data, errors = validate_card(full_card(cvc=123), today=TODAY)
    assert errors == {}
    assert data["cvc"] == "123"
    for wrong in (True, 1.5, "x", [1]):
        _, errors = validate_card(full_card(cvc=wrong), today=TODAY)
        assert list(errors) == ["data.cvc"], wrong
    _, errors = validate_card(full_card(cvc=12), today=TODAY)
    assert list(errors) == ["data.cvc"]


@pytest.mark.parametrize("cvc", ["123", "1234", "000"])
def test_good_cvc(cvc):
    data, errors = validate_card(full_card(cvc=cvc), today=TODAY)
    assert errors == {}
    assert data["cvc"] == cvc


def test_name_rules():
    data, errors = validate_card(full_card(name="x" * 200), today=TODAY)
    assert errors == {}
    assert data["name"] == "x" * 200
    _, errors = validate_card(full_card(name="x" * 201), today=TODAY)
    assert errors == {"data.name": ["must be at most 200 characters"]}
    _, errors = validate_card(full_card(name=42), today=TODAY)
    assert errors == {"data.name": ["must be a string"]}


def test_several_errors_are_reported_together_with_a_custom_prefix():
    _, errors = validate_card(
        {"number": "abc", "expiration_month": 13, "cvc": 1, "extra": 1}, today=TODAY, prefix="card"
    )
    assert set(errors) == {
        "card.number",
        "card.expiration_month",
        "card.expiration_year",
        "card.cvc",
        "card.extra",
    }


# --- bank validation ----------------------------------------------------------------------------


def test_aba_checksum():
    assert aba_checksum_valid("021000021") is True
    assert aba_checksum_valid("011000015") is True
    assert aba_checksum_valid("021000022") is False
    assert aba_checksum_valid("02100002") is False
    assert aba_checksum_valid(21000021) is False


def test_valid_bank():
    data, errors = validate_bank({"routing_number": "021000021", "account_number": "000123456789"})
    assert errors == {}
    assert data == {"routing_number": "021000021", "account_number": "000123456789"}


def test_bad_routing_checksum():
    data, errors = validate_bank({"routing_number": "021000022", "account_number": "123456789"})
    assert data is None
    assert list(errors) == ["data.routing_number"]
    assert "ABA" in errors["data.routing_number"][0]


@pytest.mark.parametrize(
    ("routing", "message"),
    [
        ("02100002", "must be exactly 9 digits"),
        ("0210000211", "must be exactly 9 digits"),
        ("02100002a", "must contain digits only (no spaces, dashes or other characters)"),
        (21000021, "must be a string"),
    ],
)
def test_bad_routing_format(routing, message):
    _, errors = validate_bank({"routing_number": routing, "account_number": "1234"})
    assert errors == {"data.routing_number": [message]}


@pytest.mark.parametrize("account", ["123", "123456789012345678", "12-34", 12345678])
def test_bad_account_number(account):
    _, errors = validate_bank({"routing_number": "021000021", "account_number": account})
    assert list(errors) == ["data.account_number"]


@pytest.mark.parametrize("account", ["1234", "12345678901234567"])
def test_account_number_bounds(account):
    _, errors = validate_bank({"routing_number": "021000021", "account_number": account})
    assert errors == {}


def test_bank_required_fields_and_unknown_keys():
    data, errors = validate_bank({"iban": "x"}, prefix="bank")
    assert data is None
    assert errors["bank.routing_number"] == ["is required"]
    assert errors["bank.account_number"] == ["is required"]
    assert "'iban'" in errors["bank.iban"][0]


def test_bank_data_must_be_an_object():
    assert validate_bank(["021000021"]) == (None, {"data": ["must be an object"]})


# --- default masks and fingerprints -------------------------------------------------------------


def test_default_masks_are_fresh_valid_templates():
    assert default_card_mask() == {
        "number": "{{ data.number | card_mask }}",
        "expiration_month": "{{ data.expiration_month }}",
        "expiration_year": "{{ data.expiration_year }}",
    }
    assert default_bank_mask() == {
        "routing_number": "{{ data.routing_number }}",
        "account_number": "{{ data.account_number | reveal_last: 4 }}",
    }
    default_card_mask()["number"] = "changed"
    assert default_card_mask()["number"] == "{{ data.number | card_mask }}"
    assert validate_mask(default_card_mask()) == []
    assert validate_mask(default_bank_mask()) == []


def test_default_card_mask_applied_keeps_types_and_hides_name_and_cvc():
    masked = apply_mask(default_card_mask(), make_context("card", full_card()))
    assert masked == {"number": "424242XXXXXX4242", "expiration_month": 12, "expiration_year": 2030}


def test_default_card_mask_for_a_card_without_expiration():
    masked = apply_mask(default_card_mask(), make_context("card", {"number": VISA}))
    assert masked == {"number": "424242XXXXXX4242", "expiration_month": None, "expiration_year": None}


def test_default_bank_mask_applied():
    data = {"routing_number": "021000021", "account_number": "000123456789"}
    masked = apply_mask(default_bank_mask(), make_context("bank", data))
    assert masked == {"routing_number": "021000021", "account_number": "XXXXXXXX6789"}


def test_default_fingerprint_expressions():
    assert set(DEFAULT_FINGERPRINT_EXPRESSIONS) == {"card", "bank", "token"}
    card = make_context("card", full_card())
    assert render(DEFAULT_FINGERPRINT_EXPRESSIONS["card"], card) == VISA
    bank = make_context("bank", {"routing_number": "021000021", "account_number": "1234"})
    assert render(DEFAULT_FINGERPRINT_EXPRESSIONS["bank"], bank) == "021000021|1234"
    token = make_context("token", {"b": [1, 2], "a": "x"})
    assert render(DEFAULT_FINGERPRINT_EXPRESSIONS["token"], token) == '{"a":"x","b":[1,2]}'


def test_an_expired_card_is_valid_to_vault():
    """Vaulting checks the form only (month 1-12, four-digit year, Luhn), not the date."""
    data, errors = validate_card(full_card(expiration_month=5, expiration_year=2001), today=TODAY, check_expiry=False)
    assert errors == {}
    assert (data["expiration_month"], data["expiration_year"]) == (5, 2001)
    _, errors = validate_card(full_card(expiration_month=13, expiration_year=201), today=TODAY, check_expiry=False)
    assert set(errors) == {"data.expiration_month", "data.expiration_year"}
