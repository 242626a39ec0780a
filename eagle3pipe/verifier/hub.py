"""The Hugging Face hub, reached only for a model, dataset or prompts given by hub id, and never waited on without a
deadline: a probe bounded as a whole (3 s) says at once whether the hub answers, and a hub id that is neither local
nor cached is refused in one line when it does not; each exchange after the probe has its own limit (deadlines.py).
"""
import os
import re
import threading
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from ..base.deadlines import call, hub_seconds
from ..base.errors import UsageError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_reachable(timeout=3.0):
    """Whether the hub endpoint (through the HTTPS proxy, if one is set) answers an HTTP request within `timeout`
    seconds in all: name lookup, connection, TLS and the answer's status line. Any status counts as an answer; an
    endpoint or proxy that accepts a connection and never answers does not. Without this probe, huggingface_hub
    and datasets retry for tens of seconds (or minutes) and print pages of tracebacks."""
    if not urlsplit(hub_endpoint()).hostname:
        return False
    answered = []

    def ask():
        try:
            req = urllib.request.Request(hub_endpoint().rstrip("/") + "/api/models?limit=1", method="HEAD")
            with urllib.request.urlopen(req, timeout=timeout):
                answered.append(True)
        except urllib.error.HTTPError:
            answered.append(True)  # the server answered: that is all the probe asks
        except Exception:  # no name, refused, reset, TLS failure, a timeout: not reachable
            pass
    # urlopen's timeout is per socket operation; a daemon thread bounds the whole exchange (a dead resolver, too)
    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(timeout)
    return bool(answered)


def hub_endpoint():
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def require_hub(flag, name, local="folder", instead="give a local model folder"):
    """Refuse at once a hub id that is not in the local cache when the hub cannot be used (HF_HUB_OFFLINE, or no
    answer within 2 s), instead of the libraries' tens of seconds of retries."""
    from huggingface_hub import constants
    why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else
           None if hub_reachable() else f"the hub ({urlsplit(hub_endpoint()).hostname or hub_endpoint()}) cannot be "
                                        f"reached")
    if why:
        raise UsageError(f"{flag} {name}: not a local {local}, not in the local HF cache, and {why}; {instead}")


def hub_file(model_path, name, optional=False):
    """A file of a hub model: from the local HF cache if there, else from the hub. Only used for non-local paths.
    `optional`: None when the repository has no such file."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    cached = try_to_load_from_cache(model_path, name)
    if isinstance(cached, str):
        return cached
    if cached is not None and optional:  # the cache recorded that the repository has no such file
        return None
    require_hub("--model-path", model_path)
    try:  # the probe answered; a server that stalls after it is bounded too
        return call(hf_hub_download, hub_seconds(), f"--model-path {model_path}: {name} from the hub", model_path, name)
    except UsageError:
        raise
    except Exception as e:  # gated, missing, the network failing after the probe: all are the operator's to fix
        if optional and "EntryNotFound" in type(e).__name__:
            return None
        raise UsageError(f"--model-path {model_path}: not a local folder and {name} could not be fetched "
                         f"from the hub ({type(e).__name__}); give a local model folder")
