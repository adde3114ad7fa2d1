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
# XLA:CPU also splits each program's machine code into parts it compiles on threads of
# their own; with the two cores already busy with the workers that is overhead: one part
# (a flag for code generation only, after every HLO pass: the optimised HLO is the same)
# compiles the same programs in 15-23% less time (tests/test_functional.py and two more
# files: 11.8 s -> 10.0 s); the whole suite, three workers, 6 min 16 s -> 5 min 36 s.
# SUITE_XLA_FLAGS names what was added, for tests/helpers.py::subprocess_env.
#
# On an accelerator (BRAINTRACE_DEVICE_TESTS=1, docs/accelerators.md) none of this: the
# flags are XLA:CPU's, and matrix products run at full float32 precision, as the exactness
# tests assume (at JAX's default precision a TPU multiplies float32 in bfloat16 passes).
_FAST_COMPILE = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
if os.environ.get("BRAINTRACE_DEVICE_TESTS"):
    os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
elif (version("jaxlib").split(".")[:2] == ["0", "10"]
        and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
    os.environ["SUITE_XLA_FLAGS"] = _FAST_COMPILE

# JAX's own switch for the same trade (compile less, run slower code): XLA's backend
# optimisation level 0 and none of LLVM's expensive passes (jax/_src/compiler.py). Both
# act on the machine code only, after XLA's HLO passes: the optimised HLO program (its
# fusions as the flag above makes them, its buffer assignment, which the memory tests
# read, its sharding and collectives) is the same with or without it.
# tests/test_gradient_contract.py 93 s -> 58 s on two workers; the whole suite (three
# workers) 10-11 min -> 7.5-8.5 min, every exactness test passing unchanged. An
# environment variable, so JAX reads it when it is imported, and subprocesses and the
# notebooks' kernels inherit it; set it to 0 to run the suite on fully optimised code.
if not os.environ.get("BRAINTRACE_DEVICE_TESTS"):
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
