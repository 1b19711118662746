"""The design card's folders import under the kvferry namespace, and nothing generic leaks out."""

from __future__ import annotations

import importlib
import importlib.util

import pytest


@pytest.mark.parametrize("name", ["kvferry.core", "kvferry.backends", "kvferry.sim", "kvferry.cli"])
def test_namespaced_packages_import(name: str) -> None:
    assert importlib.import_module(name) is not None


@pytest.mark.parametrize("generic", ["core", "backends", "sim"])
def test_no_generic_top_level_package(generic: str) -> None:
    spec = importlib.util.find_spec(generic)
    # Running from the repo root may find the folder itself via sys.path; it must not be the
    # installed kvferry copy under a generic name.
    assert spec is None or "site-packages" not in (spec.origin or "")
