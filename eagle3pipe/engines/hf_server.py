"""The HF backend as an extraction engine for stage 04 --online (where vLLM is not installed, or by choice).

A small HTTP server answering the two OpenAI-API calls speculators' on-demand generation makes: GET /v1/models and
POST /v1/completions with a prompt of token ids and max_tokens=1. It runs transformers (stage 02's HFBackend: hooks
on the needed layers only) and writes each prompt's hidden states as a file in stage 02's format (CRC-32 and a
`finite` flag in the header); the response names the file in `kv_transfer_params.hidden_states_path`, as vLLM's
hidden-states connector does. Requests that arrive together run as one padded batch (up to --batch-size prompts
and --max-tokens-per-batch tokens), so several data-loader workers keep the GPU busy. A batch that runs out of
memory is retried one prompt at a time; a prompt that cannot run alone gets an HTTP 500 (the trainer skips it).

Usage (stage 04 starts it; by hand for a shared engine):
    python -m eagle3pipe.engines.hf_server --model-path M --layer-ids 2,15,27,30 --spool /tmp/hs --port 8100
"""
import argparse
import itertools
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ..formats.hidden_states import save
from .backends import HFBackend

log = logging.getLogger("eagle3.engine")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model-path", required=True)
    p.add_argument("--layer-ids", required=True, help="every stored id, the last layer's (n) included, e.g. 2,15,27,30")
    p.add_argument("--spool", required=True, help="folder the files are written to (the trainer deletes them)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens-per-batch", type=int, default=32768)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="what the model computes in (stage 04 passes its resolved --dtype); files are bf16 either way")
    return p.parse_args(argv)


class Engine:
    """One model thread takes what is queued, runs it as a batch and hands the host copies to writer threads."""

    def __init__(self, backend, spool, batch_size, max_tokens):
        self.backend, self.spool, self.batch_size, self.max_tokens = backend, spool, batch_size, max_tokens
        self.q, self.names = queue.Queue(), itertools.count()
        self.writers = ThreadPoolExecutor(4, thread_name_prefix="hs-writer")
        threading.Thread(target=self._loop, daemon=True, name="model").start()

    def submit(self, ids):
        fut = Future()
        self.q.put((ids, fut))
        return fut

    def _take(self):
        batch = [self.q.get()]
        tokens = len(batch[0][0])
        while len(batch) < self.batch_size:
            try:
                item = self.q.get(timeout=0.002)  # requests sent together arrive within a few ms
            except queue.Empty:
                break
            if tokens + len(item[0]) > self.max_tokens:
                self.q.put(item)  # goes to the next batch (order among concurrent requests does not matter)
                break
            batch.append(item)
            tokens += len(item[0])
        return batch

    def _loop(self):
        import torch
        while True:
            batch = self._take()
            try:
                self._run(batch)
            except Exception as e:
                if isinstance(e, torch.OutOfMemoryError) and len(batch) > 1:
                    self.backend.recover()
                    log.warning(f"out of memory on {len(batch)} prompts; running them one at a time")
                    for item in batch:
                        try:
                            self._run([item])
                        except Exception as e1:
                            self.backend.recover()
                            item[1].set_exception(e1)
                else:
                    self.backend.recover()
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(e)

    def _run(self, batch):
        pending = self.backend.forward([(k, ids) for k, (ids, _) in enumerate(batch)])
        self.backend.flush()  # these requests are answered now, not when the next ones arrive
        for k, (ids, fut) in enumerate(batch):
            path = os.path.join(self.spool, f"hs-{os.getpid()}-{next(self.names)}.safetensors")
            self.writers.submit(self._write, pending[k], ids, path, fut)

    @staticmethod
    def _write(p, ids, path, fut):
        import torch
        try:
            if p.event is not None:
                p.event.synchronize()  # the device-to-host copy of this prompt's states is complete
            tensors = {**p.tensors, "token_ids": torch.as_tensor(ids, dtype=torch.int64)}
            save(path, tensors, finite=int(not bool(p.bad)))
            fut.set_result(path)
        except Exception as e:
            fut.set_exception(e)


def make_handler(engine, served_name):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # one line per request would flood engine.log
            pass

        def _send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path.rstrip("/") in ("/v1/models", "/health"):
                return self._send(200, {"object": "list", "data": [
                    {"id": served_name, "object": "model", "created": 0, "owned_by": "eagle3pipe"}]})
            self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            if self.path.rstrip("/") != "/v1/completions":
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                ids = req["prompt"]
                if not (isinstance(ids, list) and ids and all(type(x) is int for x in ids)):
                    raise ValueError("prompt must be a non-empty list of token ids")
            except (ValueError, KeyError, TypeError) as e:
                return self._send(400, {"error": {"message": str(e)}})
            try:
                path = engine.submit(ids).result()
            except Exception as e:
                return self._send(500, {"error": {"message": f"{type(e).__name__}: {e}"[:500]}})
            self._send(200, {
                "id": f"cmpl-{os.path.basename(path)}", "object": "text_completion", "created": int(time.time()),
                "model": served_name,
                "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                             "prompt_token_ids": ids}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)},
                "kv_transfer_params": {"hidden_states_path": path}})
    return Handler


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    layer_ids = [int(x) for x in args.layer_ids.split(",")]
    os.makedirs(args.spool, exist_ok=True)
    t0 = time.time()
    backend = HFBackend(args.model_path, layer_ids, args.trust_remote_code, dtype=args.dtype)
    engine = Engine(backend, args.spool, args.batch_size, args.max_tokens_per_batch)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine, args.model_path))
    server.daemon_threads = True
    log.info(f"HF extraction engine: {args.model_path} on {backend.input_device} ({args.dtype}), layer ids {layer_ids}, "
             f"loaded in {time.time() - t0:.0f} s; serving http://{args.host}:{args.port}/v1")
    server.serve_forever()


if __name__ == "__main__":
    main()
