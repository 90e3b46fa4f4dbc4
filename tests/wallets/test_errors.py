"""The wallet token refusals: one stable machine code each, a 4xx problem, nothing of the token in it."""

from __future__ import annotations

from domain.wallets import errors


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_refusal_has_its_own_code_and_a_4xx_problem_body():
    classes = [errors.WalletTokenError, *_subclasses(errors.WalletTokenError)]
    codes = [cls.code for cls in classes]
    assert len(codes) == len(set(codes)) >= 15
    for cls in classes:
        problem = cls("what failed")
        assert 400 <= problem.status < 500
        assert problem.body() == {
            "type": "about:blank",
            "title": cls.title_text,
            "status": cls.status_code,
            "detail": "what failed",
            "code": cls.code,
        }
        assert str(problem) == "what failed"


def test_only_malformed_tokens_are_400():
    assert errors.MalformedToken("x").status == 400
    others = [cls for cls in _subclasses(errors.WalletTokenError) if cls is not errors.MalformedToken]
    assert {cls("x").status for cls in others} == {422}
