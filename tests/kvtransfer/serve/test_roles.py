"""The node roles (``kvtransfer.serve.roles``): one handler per ``--role`` choice."""

from __future__ import annotations

import pytest

from kvtransfer.serve.node import parser
from kvtransfer.serve.roles import ROLES, role_of


def test_every_role_choice_has_its_handler():
    choices = next(a.choices for a in parser()._actions if a.dest == "role")
    assert tuple(choices) == ROLES == ("prefill", "decode", "colocated")
    assert [role_of(r).name for r in ROLES] == list(ROLES)
    assert [r for r in ROLES if role_of(r).runs_bootstrap] == ["prefill"]


def test_an_unknown_role_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown role 'router'; expected one of \['prefill', 'decode', 'colocated'\]"):
        role_of("router")
