"""Hidden-state files: `hs_{i}.safetensors` per row i of tokenized_data.jsonl.

    hidden_states  [T, L+1, H] bf16   the auxiliary layer ids in order, then id n (last layer, pre-norm)
    token_ids      [T] int64          equal to the row's input_ids

This is what vLLM's ExampleHiddenStatesConnector writes and what speculators' trainer reads. Position t holds
the states computed *at* token t (the verifier has seen tokens 0..t); the trainer does the shift that pairs
them with token t+1.
"""
import os

HS_NAME = "hs_{}.safetensors"


def hs_path(folder, i):
    return os.path.join(folder, HS_NAME.format(i))


def check_file(path, token_ids, n_states, hidden):
    """None when the file is complete and right for this row, else the reason it is not."""
    import torch
    from safetensors import safe_open
    try:
        with safe_open(path, "pt") as f:
            keys = set(f.keys())
            if not {"hidden_states", "token_ids"} <= keys:
                return f"missing tensors (has {sorted(keys)})"
            hs = f.get_tensor("hidden_states")
            tid = f.get_tensor("token_ids")
    except FileNotFoundError:
        return "missing"
    except Exception as e:  # truncated, foreign, corrupt header
        return f"unreadable ({type(e).__name__}: {str(e)[:80]})"
    t = len(token_ids)
    if tuple(hs.shape) != (t, n_states, hidden):
        return f"hidden_states shape {list(hs.shape)}, expected {[t, n_states, hidden]}"
    if tid.shape != (t,) or not torch.equal(tid.to(torch.int64), torch.as_tensor(token_ids, dtype=torch.int64)):
        return "token_ids differ from the prepared row"
    if not torch.isfinite(hs.float() if hs.dtype != torch.float32 else hs).all():
        return "non-finite values"
    return None


def save(path, hidden_states, token_ids):
    """Atomic write: a temporary name in the same folder, renamed when complete."""
    from safetensors.torch import save_file
    from .files import atomic_path
    with atomic_path(path) as tmp:
        save_file({"hidden_states": hidden_states.contiguous(), "token_ids": token_ids.contiguous()}, tmp)
