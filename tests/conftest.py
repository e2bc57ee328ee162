"""Shared test set-up: CPU only, deterministic, hypothesis profiles sized for CI."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=True, print_blob=True)
hypothesis.settings.register_profile("dev", max_examples=40, deadline=None)
hypothesis.settings.register_profile("slow", max_examples=200, deadline=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
