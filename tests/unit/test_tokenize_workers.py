"""How many processes stage 01 renders and tokenizes with (eagle3pipe/tokenize_workers.py): the flag where given,
else one for a small job or after --regenerate, else the cores up to a cap. The rows they make: C/test_prepare_vocab.py;
their ends: R/test_stage01_workers.py."""
import os

from eagle3pipe import tokenize_workers as tw


def test_the_worker_count_follows_the_flag_the_job_and_the_cores():
    cores = len(os.sched_getaffinity(0))
    assert tw.count(3, 10_000) == 3
    assert tw.count(8, 5) == 5                      # never more workers than conversations
    assert tw.count(None, tw.AUTO_MIN_RECORDS - 1) == 1
    assert tw.count(None, 100_000, regenerate=True) == 1
    assert tw.count(None, 100_000) == min(cores, tw.AUTO_MAX_WORKERS)
    assert tw.count(2, 100_000, regenerate=True) == 2  # asked for: given
    assert tw.count(0, 100_000) == 1                   # a config's num_workers: 0, stage 04's CPU value too
    assert 1 <= tw.cores() <= cores
