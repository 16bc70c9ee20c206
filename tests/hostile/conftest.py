"""The hostile-input catalogue's fixtures; the harness itself (snapshot, invoke, refused) is tests/hostile/hostilekit.py."""

from __future__ import annotations

import pytest
from hostilekit import unchanged_tree


@pytest.fixture()
def unchanged():
    """unchanged(root, *allowed): a context that asserts nothing under root but `allowed` paths changed."""
    return unchanged_tree
