"""Root conftest: hypothesis profiles and the pytester fixture.

`default` is fast for local runs; `ci` (chosen automatically when CI is set, or with
HYPOTHESIS_PROFILE=ci) runs more examples, derandomized so a CI failure reproduces.
"""

import contextlib
import os

import torch
from hypothesis import HealthCheck, settings

# The package imports torch/h5py lazily (cheap pytest startup for projects that don't use it).
# In-process pytester runs drop modules first imported inside them, and h5py, matplotlib and
# torch's lazily imported compiler stack cannot be imported twice in one process: import them
# once here, outside any inner run.
import activation_guard.api.run
import activation_guard.calibration.calibrate  # noqa: F401
from activation_guard.api.determinism import deterministic
from activation_guard.report import visual

with deterministic(0):  # imports torch._dynamo & co. (via the determinism switches)
    pass
visual.plot_available()  # imports matplotlib when installed
with contextlib.suppress(ImportError):  # the heatmap's contour lines load it lazily, once per process
    import contourpy  # noqa: F401

# The suite runs under `pytest -n 2` on 2-core machines: two workers each spinning two OpenMP
# threads turn a 0.2 ms tiny forward into 0.2 s. One intra-op thread per worker.
torch.set_num_threads(1)

pytest_plugins = ["pytester"]

settings.register_profile(
    "default", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))
