"""What must not depend on where a file sits: the compile-cache identity of the rewrite, and which frames
are the user's. Both once read "the files beside this one"; moving a module broke them without an error."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from teraio.graph import compilers
from teraio.lifecycle import discarded_forwards


def test_every_module_of_the_rewrite_identity_resolves_by_its_import_name():
    for name in compilers._REWRITE_MODULES:
        assert Path(importlib.import_module(name).__file__).is_file(), name


def test_the_identity_follows_the_modules_and_refuses_a_name_that_no_longer_resolves(monkeypatch):
    whole = compilers.source_digest()
    assert whole == compilers.source_digest()  # deterministic
    monkeypatch.setattr(compilers, "_REWRITE_MODULES", compilers._REWRITE_MODULES[:-1])
    assert compilers.source_digest() != whole  # each module counts
    monkeypatch.setattr(compilers, "_REWRITE_MODULES", (*compilers._REWRITE_MODULES, "teraio.graph.no_such"))
    with pytest.raises(RuntimeError, match="teraio.graph.no_such"):
        compilers.source_digest()


def test_frames_of_every_teraio_package_are_not_the_users():
    import teraio
    import teraio.planner
    import teraio.runtime

    for package in (teraio, teraio.planner, teraio.runtime):
        folder = os.path.abspath(os.path.dirname(package.__file__)) + os.sep
        assert folder in discarded_forwards._SKIPPED_PREFIXES, package.__name__


def test_a_call_site_is_the_users_frame(tmp_path):
    """A function in a file outside teraio that calls ``call_site`` through teraio code is the site."""
    user = tmp_path / "user_loop.py"
    user.write_text(
        "from teraio.lifecycle.discarded_forwards import call_site\n\ndef step():\n    return call_site()\n"
    )
    namespace: dict = {}
    exec(compile(user.read_text(), str(user), "exec"), namespace)
    site = namespace["step"]()
    assert site[0] == (str(user), 4)
