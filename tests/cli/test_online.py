"""Stage 04 --online: the flags and the engine preflight refuse in seconds with one line."""
import socket

import pytest

from conftest import assert_refused, online_args, run_script


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("extra,needles", [
    (["--cache-gb", "1"], ["--cache-gb", "only with --online"]),
    (["--online", "--engine-address", "nohost"], ["--engine-address", "host:port"]),
    (["--online", "--engine-address", "127.0.0.1:{closed}", "--engine-spool", "/tmp"], ["no engine answers", "start it first"]),
    (["--online", "--engine-address", "127.0.0.1:8000"], ["--engine-spool", "reads and deletes an engine's files only"]),
    (["--online", "--engine-spool", "/tmp"], ["--engine-spool", "only with --engine-address"]),
    (["--online", "--engine-address", "127.0.0.1:8000", "--engine-spool", "/tmp", "--engine-gpus", "0"],
     ["--engine-gpus", "already running"]),
    (["--online", "--engine-gpus", "0"], ["--engine-gpus 0", "no GPU visible"]),
    (["--online", "--engine-port", "{busy}"], ["--engine-port", "in use"]),
    (["--online", "--layer-ids", "2,40"], ["--layer-ids", "out of range"]),
    (["--online", "--cache-gb", "-1"], ["--cache-gb", "at least 0"]),
])
def test_online_preflight_refuses_in_seconds(small, model_path, tmp_path, extra, needles):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    extra = [x.format(closed=closed_port(), busy=busy.getsockname()[1]) for x in extra]
    argv = online_args(model_path, small, tmp_path / "ck", *extra)
    if "--online" not in extra:
        argv.remove("--online")
    try:
        assert_refused(*run_script(*argv, env={"CUDA_VISIBLE_DEVICES": ""}), *needles)
    finally:
        busy.close()
    assert not (tmp_path / "ck").exists()
