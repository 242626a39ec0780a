"""The HF backend's deferred host copy (issue 15): a writer thread waiting on a batch's copy is held until the copy is
queued, and gets an error (not a hang) when queuing it failed. The copy itself needs CUDA: on a GPU,
`bench/diag_extract_gpu.py --check` compares deferred against immediate copies byte for byte."""
import threading


from eagle3pipe.engines.backends import DeferredCopy



def test_a_waiting_writer_is_held_until_the_copy_is_queued_then_fails_if_it_never_was():
    copy, result = DeferredCopy(), {}

    def writer():
        try:
            copy.synchronize()
            result["ok"] = True
        except RuntimeError as e:
            result["error"] = str(e)
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive() and not result  # still waiting: nothing queued yet
    copy.queued.set()  # what HFBackend.flush's `finally` does when launching the copy raised
    t.join(5)
    assert not t.is_alive() and "never queued" in result["error"]
