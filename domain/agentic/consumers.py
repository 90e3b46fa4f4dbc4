"""The consumer of a payment method: country and language codes (spec 001 section 2, Consumer).

* ``country_code``: an ISO 3166-1 alpha-2 code; lowercase is normalised to uppercase. Only codes
  officially assigned by ISO 3166-1 are accepted (:data:`ISO_3166_ALPHA2`); user-assigned and
  reserved codes (``XK``, ``EU``, ``ZZ`` ...) are not.
* ``language_code``: a BCP 47 tag of 2 to 35 characters, canonicalised with ``langcodes``
  (``en-gb`` -> ``en-GB``, ``iw`` -> ``he``, ``zh-hant-tw`` -> ``zh-Hant-TW``). Only letters, digits
  and hyphens are accepted (``en_US`` is not a BCP 47 tag).
"""

from __future__ import annotations

import re

import langcodes

#: The 249 codes officially assigned by ISO 3166-1 (alpha-2).
ISO_3166_ALPHA2 = frozenset(
    """
    AD AE AF AG AI AL AM AO AQ AR AS AT AU AW AX AZ BA BB BD BE BF BG BH BI BJ BL BM BN BO BQ BR BS BT
    BV BW BY BZ CA CC CD CF CG CH CI CK CL CM CN CO CR CU CV CW CX CY CZ DE DJ DK DM DO DZ EC EE EG EH
    ER ES ET FI FJ FK FM FO FR GA GB GD GE GF GG GH GI GL GM GN GP GQ GR GS GT GU GW GY HK HM HN HR HT
    HU ID IE IL IM IN IO IQ IR IS IT JE JM JO JP KE KG KH KI KM KN KP KR KW KY KZ LA LB LC LI LK LR LS
    LT LU LV LY MA MC MD ME MF MG MH MK ML MM MN MO MP MQ MR MS MT MU MV MW MX MY MZ NA NC NE NF NG NI
    NL NO NP NR NU NZ OM PA PE PF PG PH PK PL PM PN PR PS PT PW PY QA RE RO RS RU RW SA SB SC SD SE SG
    SH SI SJ SK SL SM SN SO SR SS ST SV SX SY SZ TC TD TF TG TH TJ TK TL TM TN TO TR TT TV TW TZ UA UG
    UM US UY UZ VA VC VE VG VI VN VU WF WS YE YT ZA ZM ZW
    """.split()
)

_TAG_CHARACTERS = re.compile(r"[A-Za-z0-9]+(-[A-Za-z0-9]+)*")
MIN_LANGUAGE_CODE, MAX_LANGUAGE_CODE = 2, 35


def normalize_country_code(value: str) -> str:
    """``value`` upper-cased when it is an assigned ISO 3166-1 alpha-2 code; ValueError otherwise."""
    code = value.upper()
    if len(code) != 2 or code not in ISO_3166_ALPHA2:
        raise ValueError("must be an ISO 3166-1 alpha-2 country code, like US or GB")
    return code


def canonical_language_code(value: str) -> str:
    """The canonical form of the BCP 47 tag ``value``; ValueError when it is not one (or its length,
    before or after canonicalisation, is outside 2 to 35 characters)."""
    if not MIN_LANGUAGE_CODE <= len(value) <= MAX_LANGUAGE_CODE or not _TAG_CHARACTERS.fullmatch(value):
        raise ValueError("must be a BCP 47 language tag of 2 to 35 characters, like en or en-GB")
    try:
        valid = langcodes.tag_is_valid(value)
        canonical = langcodes.standardize_tag(value) if valid else None
    except (ValueError, langcodes.LanguageTagError):
        canonical = None
    if not canonical or not MIN_LANGUAGE_CODE <= len(canonical) <= MAX_LANGUAGE_CODE:
        raise ValueError("must be a BCP 47 language tag of 2 to 35 characters, like en or en-GB")
    return canonical
