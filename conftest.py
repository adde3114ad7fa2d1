"""Test-session defaults shared by every test module."""

import os
from importlib.metadata import version

# Notebooks (run by nbmake in their own kernels, which inherit the environment)
# and demonstrations read this to shrink their sizes.
os.environ.setdefault("BRAINTRACE_QUICK", "1")

# The suite checks what the compiled programs compute, not how fast they run, and
# most of its time is XLA:CPU compiling small programs once each. With its MLIR fusion
# emitters (the default) XLA compiles them 2.5x slower than with its previous ones:
# tests/test_gradient_contract.py 124 s -> 48 s on two workers. The flag changes how
# XLA fuses and generates code (a GRU's grad program: 88 fusions instead of 129), not
# the program before fusion: its sharding and the collectives some tests read are
# decided earlier. Set before JAX starts its backend; subprocesses and the notebooks'
# kernels inherit it. Only for the jaxlib it was checked with (XLA aborts at start on a
# flag it does not know); the benchmarks and `python -m braintrace` keep XLA's defaults.
# SUITE_XLA_FLAGS names what was added, for tests/helpers.py::subprocess_env.
_FAST_COMPILE = "--xla_cpu_use_fusion_emitters=false"
if (version("jaxlib").split(".")[:2] == ["0", "10"]
        and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
    os.environ["SUITE_XLA_FLAGS"] = _FAST_COMPILE
