"""Test-wide setup: 8 fake CPU devices, so multi-device code paths run on any machine.

Must run before the first backend use; pytest imports conftest.py before collecting tests.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
