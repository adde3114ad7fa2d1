"""Test-session defaults shared by every test module."""

import os

# Notebooks (run by nbmake in their own kernels, which inherit the environment)
# and demonstrations read this to shrink their sizes.
os.environ.setdefault("BRAINTRACE_QUICK", "1")
