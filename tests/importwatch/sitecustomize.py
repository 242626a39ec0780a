"""Loaded by every Python process the tests start (conftest.run_script puts this folder on PYTHONPATH): records
which heavy libraries the process imported, as they are imported, into $EAGLE3_TEST_IMPORT_LOG. A refusal the
README promises "before any heavy import or model load" is checked against this record, not against a clock."""
import os
import sys

_LOG = os.environ.get("EAGLE3_TEST_IMPORT_LOG")
HEAVY = ("torch", "vllm", "transformers", "speculators")


class _Watch:
    def find_spec(self, name, path=None, target=None):
        if name in HEAVY and not _asked_only():
            with open(_LOG, "a") as f:
                f.write(f"{name}\n")
        return None


def _asked_only():
    """importlib.util.find_spec("torch") (is it installed?) asks the finders too, and imports nothing."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "find_spec" and "importlib" in f.f_code.co_filename and "util" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


if _LOG:
    sys.meta_path.insert(0, _Watch())
