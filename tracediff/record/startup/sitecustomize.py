"""Put first on PYTHONPATH by ``tracediff record``: loads the recording plugins in this process, then
runs the ``sitecustomize`` that would have run without us (e.g. Debian's), so the host behaves as
before. Never raises: a failure here must not stop the host program. Kept to syntax old Pythons read.
"""

import os
import sys


def _tracediff_startup() -> None:
    try:
        from tracediff.record.child import startup
    except Exception as exc:  # tracediff not installed for this interpreter, or broken
        sys.stderr.write("tracediff: not importable by " + sys.executable + " (" + str(exc)
                         + "); this process records nothing\n")
        return
    try:
        startup()
    except Exception as exc:
        sys.stderr.write("tracediff: startup failed (" + str(exc) + "); this process records nothing\n")


def _chain_previous() -> None:
    """Run the next ``sitecustomize`` on sys.path, as Python would have without ours first."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _chain_previous()  # first: it may set up the paths tracediff imports from
finally:
    if os.environ.get("TRACEDIFF_LAUNCH"):
        _tracediff_startup()
