"""The notebook run (``make test-notebooks``) compiles as the unit tests do: XLA's older CPU
code generator where the installed XLA has it (tests/compile_settings.py). The kernels that
run the notebooks inherit the environment."""

from tests import compile_settings

compile_settings.apply()
