"""Pallas kernels for jaxsoft (imported lazily by ``implementation="pallas*"``)."""
