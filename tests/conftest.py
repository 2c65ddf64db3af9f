"""Shared test setup: 8 fake CPU devices (set before jax is imported), offline tiktoken, shared data."""

import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
if (SHARED / "tiktoken_cache").is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED / "tiktoken_cache"))

import pytest  # noqa: E402

SHAKESPEARE = SHARED / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="session")
def shakespeare_text() -> str:
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} is absent (it lives in the project's ../shared, not in a user's clone)")
    return SHAKESPEARE.read_text(encoding="utf-8")
